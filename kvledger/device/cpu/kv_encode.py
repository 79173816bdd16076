"""The native int8 / int4 block encoder (``int_encode.cpp``): quantize full KV blocks and store
them into the pool in one call.

A decode step in which a sequence's last block fills quantizes that block for K and V of every
layer; through the codec's PyTorch code (``kvledger.engine.kv.codecs.IntCodec.encode``) that is
~20 PyTorch ops plus one ``index_copy_`` per field each time, on small tensors where each op
costs its dispatch. The native encoder does the same arithmetic (bytes equal, tested in
``tests/device/cpu/test_kv_encode.py``) and writes codes, scales, zero points and outlier
channels at the blocks' ids directly. It takes the codec as its numbers (bits, scale group,
centring, least scale, outlier channels), the engine's codec objects stay above the device.

:func:`encoder` returns None when the native library cannot be built (``KVLEDGER_NATIVE=0``,
no compiler); the quantized KV store then encodes with the codec's PyTorch code.
"""

from __future__ import annotations

import ctypes

import torch

from kvledger.device.cpu.native import DTYPE_CODES, library


class NativeIntEncoder:
    """ctypes wrapper of ``kvl_encode_int``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvl_encode_int
        i32, ptr = ctypes.c_int, ctypes.c_void_p
        self._fn.argtypes = [ptr, i32, i32, i32, i32, i32, i32, i32, i32, ctypes.c_float,
                             ptr, ptr, ptr, ptr, ptr, i32, ptr]
        self._fn.restype = i32

    def encode_into(self, blocks: torch.Tensor, parts: dict[str, torch.Tensor],
                    block_ids: torch.Tensor, *, bits: int, group: int, centred: bool,
                    min_scale: float, channels: torch.Tensor | None = None) -> bool:
        """Quantize ``blocks`` [n, bs, kv_heads, D] (fp32 or bf16) to ``bits``-bit integers
        with a scale and zero point per ``group`` elements along D (0: per channel over a
        block's tokens), zero points centred when ``centred``, scales at least ``min_scale``,
        the ``channels`` [kv_heads, n_out] long kept apart in fp16 when given, and write each
        field into ``parts[name][block_ids]`` (``block_ids`` [n] int64). Returns False,
        writing nothing, for a dtype or layout the kernel does not take (the caller then
        encodes in PyTorch)."""
        if blocks.dtype not in DTYPE_CODES or not all(t.is_contiguous() for t in parts.values()):
            return False
        blocks, block_ids = blocks.contiguous(), block_ids.contiguous()
        channels = None if channels is None else channels.contiguous()
        n, bs, heads, dim = blocks.shape
        no = 0 if channels is None else channels.shape[1]
        failed = self._fn(blocks.data_ptr(), DTYPE_CODES[blocks.dtype], n, bs, heads, dim,
                          bits, group, int(centred), min_scale, block_ids.data_ptr(),
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
