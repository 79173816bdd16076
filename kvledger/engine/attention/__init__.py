"""Attention backends over the paged KV cache, and the per-step metadata they share.

Backends (``KVLEDGER_ATTENTION`` or the engine option picks one; default: what the probe chose):

- ``reference``: gather + PyTorch SDPA (:mod:`.reference`), the oracle of the tests;
- ``paged-torch``: block-chunked online softmax in PyTorch ops (:mod:`.paged`);
- ``paged-native``: the same in C++, K/V read in place (:mod:`.paged`,
  :mod:`kvledger.device.cpu.native`).
"""

from __future__ import annotations

from kvledger.engine.attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    PagedQueries,
    PrefillSegment,
)
from kvledger.engine.attention.reference import AttentionBackend, ReferenceBackend
from kvledger.errors import InvalidParameterError

BACKENDS = ("reference", "paged-torch", "paged-native")

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "DecodeGroup", "PagedQueries",
           "PrefillSegment", "make_backend"]


def make_backend(name: str) -> AttentionBackend:
    """The backend called ``name`` (one of :data:`BACKENDS`).

    ``paged-native`` falls back to ``paged-torch`` (logged) when the kernel cannot be built.

    Raises:
        InvalidParameterError: an unknown name.
    """
    from kvledger.device.cpu import native
    from kvledger.engine.attention.paged import PagedNativeBackend, PagedTorchBackend

    if name == "reference":
        return ReferenceBackend()
    if name == "paged-torch":
        return PagedTorchBackend()
    if name == "paged-native":
        try:
            return PagedNativeBackend()
        except native.NativeUnavailable:
            return PagedTorchBackend()
    raise InvalidParameterError(f"attention backend must be one of {', '.join(BACKENDS)}, "
                                f"got {name!r}")
