"""The fused element-wise ops of a decoder layer in C++ (``csrc/fused_ops.cpp``), with the
PyTorch ones (:class:`kvledger.device.ops.TorchOps`) as fallback.

A decode step runs a few matmuls and a few hundred tiny element-wise ops; on CPU each PyTorch
op costs microseconds of dispatch whatever its size, so the native ops replace 3-10 ops each
(their formulas: :mod:`kvledger.device.ops`). Arithmetic is fp32 for fp32 and bf16 tensors (one
rounding per bf16 result), so both give the same results to rounding. :func:`fused_ops`
returns the native ops, or the PyTorch ones when the native library cannot be built
(:mod:`kvledger.device.cpu.native`; ``KVLEDGER_NATIVE=0``). The native ops vectorise and split
a prefill's many rows over torch's threads; each takes at most the rows the kernel probe
measured it faster at (``kvledger.engine.tuning.probe.ProbeResult.fused_max_rows``; no
limit where it won at every measured count), more rows go to PyTorch.
"""

from __future__ import annotations

import ctypes

import torch

from kvledger.device.cpu.native import DTYPE_CODES, library
from kvledger.device.ops import TorchOps


class NativeOps(TorchOps):
    """The C++ ops; tensors of another dtype or layout, or more rows than ``max_rows`` allows
    (op -> dtype -> rows; an op or dtype left out has no limit), go to the PyTorch ones."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL,
                 max_rows: dict[str, dict[torch.dtype, int]] | None = None) -> None:
        self._max_rows = {(op, dtype): rows for op, by_dtype in (max_rows or {}).items()
                          for dtype, rows in by_dtype.items()}
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self._norm = lib.kvl_add_rms_norm
        self._norm.argtypes = [ptr] * 4 + [i32, i32, ctypes.c_float, i32, i32]
        self._rope = lib.kvl_rope
        self._rope.argtypes = [ptr, i64, i32, i32, i32, ptr, ptr, ptr, i32]
        self._glu = {"silu_mul": lib.kvl_silu_mul, "gelu_tanh_mul": lib.kvl_gelu_tanh_mul}
        for fn in (self._norm, self._rope, *self._glu.values()):
            fn.restype = None
        for fn in self._glu.values():
            fn.argtypes = [ptr, ptr, i32, i32, i32]

    def _too_many(self, op: str, t: torch.Tensor) -> bool:
        limit = self._max_rows.get((op, t.dtype))
        return limit is not None and t.shape[0] > limit

    def add_rms_norm(self, h, delta, weight, eps):
        """In place: ``h`` itself becomes h + delta (h must be a tensor the caller owns)."""
        if not (h.dtype in DTYPE_CODES and h.is_contiguous()
                and weight.dtype in (h.dtype, torch.float32)
                and (delta is None or (delta.dtype == h.dtype and delta.is_contiguous()))
                and not self._too_many("add_rms_norm", h)):
            return super().add_rms_norm(h, delta, weight, eps)
        out = torch.empty_like(h)
        rows, dim = h.shape
        self._norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                   out.data_ptr(), rows, dim, eps, DTYPE_CODES[h.dtype],
                   DTYPE_CODES[weight.dtype])
        return h, out

    def rope_(self, qk, positions, rope):
        """In place on qk [T, heads, D] whose heads are contiguous within each token's row and
        turn whole (a partial rotary factor takes the PyTorch op)."""
        tokens, heads, dim = qk.shape
        if (qk.dtype not in DTYPE_CODES or qk.stride(2) != 1 or qk.stride(1) != dim
                or positions.dtype != torch.int64 or rope.rotary_dim != dim):
            return super().rope_(qk, positions, rope)
        positions = positions.contiguous()
        rope.cover(positions)
        self._rope(qk.data_ptr(), qk.stride(0), tokens, heads, dim, rope.cos_half.data_ptr(),
                   rope.sin_half.data_ptr(), positions.data_ptr(), DTYPE_CODES[qk.dtype])
        return qk

    def silu_mul(self, gate_up):
        return self._glu_mul("silu_mul", gate_up)

    def gelu_tanh_mul(self, gate_up):
        return self._glu_mul("gelu_tanh_mul", gate_up)

    def _glu_mul(self, op: str, gate_up: torch.Tensor) -> torch.Tensor:
        """``op`` (``silu_mul`` or ``gelu_tanh_mul``) on gate_up [T, 2f] -> [T, f]."""
        if (gate_up.dtype not in DTYPE_CODES or not gate_up.is_contiguous()
                or self._too_many(op, gate_up)):
            return getattr(super(), op)(gate_up)
        rows, width = gate_up.shape
        out = gate_up.new_empty(rows, width // 2)
        self._glu[op](gate_up.data_ptr(), out.data_ptr(), rows, width // 2,
                      DTYPE_CODES[gate_up.dtype])
        return out


def fused_ops(max_rows: dict[str, dict[torch.dtype, int]] | None = None) -> TorchOps:
    """The native ops (limited to ``max_rows``, see :class:`NativeOps`) when the library builds
    here, else the PyTorch ones."""
    lib = library()
    return TorchOps() if lib is None else NativeOps(lib, max_rows)
