"""Attention backends over the paged KV cache, and the per-step metadata they share.

Backends (``KVLEDGER_ATTENTION`` or the engine option picks one; default: what the probe chose):

- ``reference``: gather + PyTorch SDPA (:mod:`.reference`), the oracle of the tests;
- ``paged-torch``: block-chunked online softmax in PyTorch ops (:mod:`.paged`);
- ``paged-native``: the same in the device's kernel, K/V read in place (:mod:`.paged`,
  ``kvledger.device.Kernels.paged_attention``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvledger.engine.attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    PagedQueries,
    PrefillSegment,
)
from kvledger.engine.attention.reference import AttentionBackend, ReferenceBackend
from kvledger.errors import InvalidParameterError

if TYPE_CHECKING:
    from kvledger.device import Kernels

BACKENDS = ("reference", "paged-torch", "paged-native")

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "DecodeGroup", "PagedQueries",
           "PrefillSegment", "make_backend"]


def make_backend(name: str, kernels: Kernels) -> AttentionBackend:
    """The backend called ``name`` (one of :data:`BACKENDS`) over the device's ``kernels``.

    ``paged-native`` falls back to ``paged-torch`` (the library logged why) when the device has
    no paged-attention kernel.

    Raises:
        InvalidParameterError: an unknown name.
    """
    from kvledger.engine.attention.paged import PagedNativeBackend, PagedTorchBackend

    if name == "reference":
        return ReferenceBackend()
    if name == "paged-torch":
        return PagedTorchBackend()
    if name == "paged-native":
        kernel = kernels.paged_attention()
        return PagedTorchBackend() if kernel is None else PagedNativeBackend(kernel)
    raise InvalidParameterError(f"attention backend must be one of {', '.join(BACKENDS)}, "
                                f"got {name!r}")
