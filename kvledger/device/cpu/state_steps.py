"""The native decode steps of the state mixers (``csrc/state_steps.cpp``): the conv update and
the recurrent update of gated DeltaNet and of Mamba-2, one token per sequence, written straight
into the step's gathered state rows.

A decode token through PyTorch costs ~15 small ops per layer (the conv window, the norms and
gates, the state update and read), each a few microseconds of dispatch; the kernels do each
mixer's step in two calls, in fp32 arithmetic (the formulas:
:mod:`kvledger.model.layers.gated_deltanet`, :mod:`kvledger.model.layers.mamba2`; the tests
hold them to the PyTorch steps), DeltaNet's gated RMSNorm included. They take states in fp32
or bf16 (the engine keeps them in its compute dtype), the projection's columns in fp32 or bf16,
and the state's last dimension (dv, d_state) a multiple of the build's vector lanes; anything
else is the caller's PyTorch path. :func:`kernel` is None when the native library cannot be built.
"""

from __future__ import annotations

import ctypes

import torch

from kvledger.device.cpu.native import DTYPE_CODES, library


def _strided_rows(t: torch.Tensor) -> bool:
    """Rows of contiguous elements (a column slice of a contiguous matrix)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.dtype in DTYPE_CODES


class StateStepKernel:
    """ctypes wrapper of ``kvl_conv_step``, ``kvl_delta_step`` and ``kvl_ssd_step``."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        self.lanes, self.max_key_dim = lib.kvl_state_lanes(), lib.kvl_state_max_key_dim()
        self._conv = lib.kvl_conv_step
        self._conv.argtypes = [ptr, i64, i32, ptr, i32, ptr, i32, i32, i32, ptr, ptr, ptr]
        self._delta = lib.kvl_delta_step
        self._delta.argtypes = [ptr, ptr, ptr, i64, i32, ptr, i32, ptr] + [i32] * 5 \
            + [ptr] * 4 + [i64, ptr, f32, ptr]
        self._ssd = lib.kvl_ssd_step
        self._ssd.argtypes = [ptr, ptr, i64, i32, ptr, i32, ptr] + [i32] * 5 + [ptr] * 3 \
            + [f32, f32, ptr]
        for fn in (self._conv, self._delta, self._ssd):
            fn.restype = None

    def accepts_delta(self, head_k_dim: int, head_v_dim: int) -> bool:
        """Whether the DeltaNet step takes these head sizes."""
        return head_v_dim % self.lanes == 0 and head_k_dim <= self.max_key_dim

    def accepts_ssd(self, d_state: int) -> bool:
        """Whether the Mamba-2 step takes this state size."""
        return d_state % self.lanes == 0

    @staticmethod
    def takes(state_conv: torch.Tensor, state_recurrent: torch.Tensor,
              *columns: torch.Tensor) -> bool:
        """Whether the tensors of one call are laid out as the kernels read them: contiguous
        states of one dtype (fp32 or bf16), the projection's columns (one dtype) as rows of
        contiguous elements."""
        return (state_conv.dtype in DTYPE_CODES and state_recurrent.dtype == state_conv.dtype
                and state_conv.is_contiguous() and state_recurrent.is_contiguous()
                and all(_strided_rows(c) and c.dtype == columns[0].dtype for c in columns))

    def conv(self, x: torch.Tensor, window: torch.Tensor, rows: torch.Tensor,
             weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """SiLU of the conv of x [n, C] after ``window[rows[i]]`` [C, K - 1] (shifted in
        place); weight fp32 [C, K], bias fp32 [C] or None -> fp32 [n, C]."""
        n, channels = x.shape
        out = torch.empty(n, channels)
        self._conv(x.data_ptr(), x.stride(0), DTYPE_CODES[x.dtype], window.data_ptr(),
                   DTYPE_CODES[window.dtype], rows.data_ptr(), n, channels, weight.shape[1],
                   weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr())
        return out

    def delta(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              recurrent: torch.Tensor, rows: torch.Tensor, num_k_heads: int,
              neg_A: torch.Tensor, dt_bias: torch.Tensor,
              gate: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
        """The gated delta rule on the conv's q, k, v ``mixed`` fp32 [n, 2 key_dim +
        value_dim] with a, b [n, Hv] (rows of one matrix), on ``recurrent[rows[i]]`` [Hv, dk,
        dv] in place -> o fp32 [n, Hv, dv]; neg_A (-exp(A_log)), dt_bias fp32 [Hv]. With
        ``gate`` = (z [n, Hv dv] in a's dtype, norm weight fp32 [dv], eps): RMSNorm(o) * weight
        * silu(z) per head instead, [n, Hv dv] in z's dtype."""
        _, hv, dk, dv = recurrent.shape
        n = mixed.shape[0]
        out = torch.empty(n, hv, dv)
        z, weight, eps = gate if gate is not None else (None, None, 0.0)
        gated = None if z is None else torch.empty(n, hv * dv, dtype=z.dtype)
        self._delta(mixed.data_ptr(), a.data_ptr(), b.data_ptr(), a.stride(0),
                    DTYPE_CODES[a.dtype], recurrent.data_ptr(), DTYPE_CODES[recurrent.dtype],
                    rows.data_ptr(), n,
                    num_k_heads, hv, dk, dv, neg_A.data_ptr(), dt_bias.data_ptr(),
                    out.data_ptr(), None if z is None else z.data_ptr(),
                    0 if z is None else z.stride(0), None if z is None else weight.data_ptr(),
                    eps, None if z is None else gated.data_ptr())
        return out if z is None else gated

    def ssd(self, mixed: torch.Tensor, dt: torch.Tensor, recurrent: torch.Tensor,
            rows: torch.Tensor, n_groups: int, A: torch.Tensor, D: torch.Tensor,
            dt_bias: torch.Tensor, dt_limits: tuple[float, float]) -> torch.Tensor:
        """The Mamba-2 step on the conv's x, B, C ``mixed`` fp32 [n, heads hd + 2 groups ds]
        with dt [n, heads] (rows of a matrix), on ``recurrent[rows[i]]`` [heads, hd, ds] in
        place -> y fp32 [n, heads, hd] (D skip included); A, D, dt_bias fp32 [heads]."""
        _, heads, hd, ds = recurrent.shape
        n = mixed.shape[0]
        out = torch.empty(n, heads, hd)
        self._ssd(mixed.data_ptr(), dt.data_ptr(), dt.stride(0), DTYPE_CODES[dt.dtype],
                  recurrent.data_ptr(), DTYPE_CODES[recurrent.dtype], rows.data_ptr(), n, heads,
                  hd, ds, n_groups,
                  A.data_ptr(), D.data_ptr(), dt_bias.data_ptr(), *dt_limits, out.data_ptr())
        return out


def kernel() -> StateStepKernel | None:
    """The native steps, or None when the native library cannot be built."""
    lib = library()
    return None if lib is None else StateStepKernel(lib)
