"""The native int8 / int4 block encoder (``int_encode.cpp``): quantize full KV blocks and store
them into the pool in one call.

A decode step in which a sequence's last block fills quantizes that block for K and V of every
layer; through :meth:`IntCodec.encode <kvledger.engine.kv.codecs.IntCodec.encode>` that is ~20
PyTorch ops plus one ``index_copy_`` per field each time, on small tensors where each op costs
its dispatch. The native encoder does the same arithmetic (bytes equal, tested in
``tests/device/cpu/test_kv_encode.py``) and writes codes, scales, zero points and outlier
channels at the blocks' ids directly.

:func:`encoder` returns None when the native library cannot be built (``KVLEDGER_NATIVE=0``,
no compiler); :class:`QuantizedKVStore <kvledger.engine.kv.quantized_store.QuantizedKVStore>`
then encodes with the codec's PyTorch code.
"""

from __future__ import annotations

import ctypes

import torch

from kvledger.device.cpu.native import DTYPE_CODES, library
from kvledger.engine.kv.codecs import MIN_SCALE, IntCodec, OutlierKeys


class NativeIntEncoder:
    """ctypes wrapper of ``kvl_encode_int``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvl_encode_int
        i32, ptr = ctypes.c_int, ctypes.c_void_p
        self._fn.argtypes = [ptr, i32, i32, i32, i32, i32, i32, i32, i32, ctypes.c_float,
                             ptr, ptr, ptr, ptr, ptr, i32, ptr]
        self._fn.restype = i32

    def encode_into(self, codec, blocks: torch.Tensor, parts: dict[str, torch.Tensor],
                    block_ids: torch.Tensor) -> bool:
        """Quantize ``blocks`` [n, bs, kv_heads, D] (fp32 or bf16) with ``codec`` and write
        each field into ``parts[name][block_ids]`` (``block_ids`` [n] int64); the bytes are
        those of ``codec.encode``. Returns False, writing nothing, for a codec, dtype or size
        the kernel does not take (the caller then uses ``codec.encode``)."""
        channels, inner = None, codec
        if isinstance(codec, OutlierKeys):
            channels, inner = codec.channels.contiguous(), codec.inner
        if (not isinstance(inner, IntCodec) or blocks.dtype not in DTYPE_CODES
                or not all(t.is_contiguous() for t in parts.values())):
            return False
        blocks, block_ids = blocks.contiguous(), block_ids.contiguous()
        n, bs, heads, dim = blocks.shape
        group = 0 if inner.axis == "per-channel" else inner.group
        no = 0 if channels is None else channels.shape[1]
        failed = self._fn(blocks.data_ptr(), DTYPE_CODES[blocks.dtype], n, bs, heads, dim,
                          inner.bits, group, int(inner.centred), MIN_SCALE, block_ids.data_ptr(),
                          parts["codes"].data_ptr(), parts["scale"].data_ptr(),
                          parts["zero"].data_ptr(),
                          None if channels is None else channels.data_ptr(), no,
                          parts["outliers"].data_ptr() if no else None)
        return failed == 0


def encoder() -> NativeIntEncoder | None:
    """The native encoder, or None when the native library cannot be built (one per store:
    :func:`library` itself is built and loaded once)."""
    lib = library()
    return None if lib is None else NativeIntEncoder(lib)
