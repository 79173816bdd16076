"""The native int8 x int8 product behind the ``w8a8`` weight format (``int8_gemv.cpp``).

``y = kernel(x, codes, scales)`` computes, for x [rows, in] bf16, the per-row int8 weight
``codes`` [out, in] and its fp32 row ``scales`` [out],

    y[r, o] = scales[o] * sum_b d[r, b] * sum_{i in b} round(x[r, i] / d[r, b]) * codes[o, i]

with blocks b of :data:`BLOCK` inputs and ``d[r, b] = max_{i in b} |x[r, i]| / 127`` (the
activation quantization of GGML's Q8_0), in bf16. Rounding x to int8 moves each input by at most
``d[r, b] / 2``, so ``|y - x @ W.T| <= scales[o] * sum_b d[r, b] / 2 * sum_{i in b} |codes[o, i]|``
plus the bf16 rounding of y (:func:`rounding_bound`). Output rows are split over
``torch.get_num_threads()`` threads (OpenMP, torch's own pool) once the weight holds at least
:data:`THREAD_BYTES`, else one.

:func:`kernel` returns None when the native library cannot be built (``KVLEDGER_NATIVE=0``, no
compiler); the format then falls back to ``int8`` (PyTorch's ``_weight_int8pack_mm``).
"""

from __future__ import annotations

import ctypes
import functools

import torch

BLOCK = 32
THREAD_BYTES = 1 << 16
"""Weights smaller than this (bytes of codes) run on one thread."""


class W8A8Kernel:
    """ctypes wrapper of ``kvl_w8a8_mm``.

    Attributes:
        vector: whether the library was built with its AVX2 path (else plain loops only).
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        self._fn = lib.kvl_w8a8_mm
        self._fn.argtypes = [ptr, i32, i32, ptr, ptr, i32, ptr, i32, i32]
        self._fn.restype = None
        self.vector = bool(lib.kvl_w8a8_vector())

    @staticmethod
    def accepts(in_features: int) -> bool:
        """Whether the kernel takes inputs of this width (whole blocks of :data:`BLOCK`)."""
        return in_features % BLOCK == 0

    def bind(self, codes: torch.Tensor, scales: torch.Tensor) -> W8A8Weight:
        """The product with one weight, checked once: int8 ``codes`` [out, in] and fp32
        ``scales`` [out], both contiguous (kept alive by the result).

        Raises:
            ValueError: a wrong dtype or layout, or ``in`` not a multiple of :data:`BLOCK`.
        """
        if (codes.dtype != torch.int8 or scales.dtype != torch.float32 or codes.dim() != 2
                or not self.accepts(codes.shape[1]) or scales.shape != codes.shape[:1]
                or not (codes.is_contiguous() and scales.is_contiguous())):
            raise ValueError("w8a8 takes contiguous int8 codes [out, in] with in % 32 == 0 "
                             "and fp32 scales [out]")
        return W8A8Weight(self._fn, codes, scales)

    def __call__(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 scalar: bool = False) -> torch.Tensor:
        """``bind(codes, scales)(x, scalar)`` (see :class:`W8A8Weight`)."""
        return self.bind(codes, scales)(x, scalar)


class W8A8Weight:
    """One weight's product (:meth:`W8A8Kernel.bind`): per call only x is checked."""

    def __init__(self, fn, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self._fn, self._held = fn, (codes, scales)
        self.out_features, self.in_features = codes.shape
        self._codes, self._scales = codes.data_ptr(), scales.data_ptr()
        self._threaded = codes.numel() >= THREAD_BYTES

    def __call__(self, x: torch.Tensor, scalar: bool = False) -> torch.Tensor:
        """[rows, in] bf16 (made contiguous here) -> [rows, out] bf16 (the module docstring);
        ``scalar`` runs the plain loops even where the AVX2 path is built (tests).

        Raises:
            ValueError: x not bf16 [rows, in].
        """
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"w8a8 takes bf16 x [rows, {self.in_features}]")
        x = x.contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.bfloat16)
        self._fn(x.data_ptr(), rows, self.in_features, self._codes, self._scales,
                 self.out_features, y.data_ptr(),
                 torch.get_num_threads() if self._threaded else 1, int(scalar))
        return y


def rounding_bound(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[rows, out] fp64 bound on ``|kernel(x, codes, scales) - x @ (codes * scales).T|`` in exact
    arithmetic: each input's int8 rounding (at most ``d / 2`` per block) times the weights it
    meets (with a 2^-7 relative margin for the fp32 block scales), plus the output's bf16
    rounding (half an ulp: 2^-8 relative), plus fp32 summation (2^-16 of the sum of |terms|,
    more than the ~50 fp32 additions of a row can lose)."""
    rows, width = x.shape
    xb = x.double().reshape(rows, width // BLOCK, BLOCK)
    half_step = xb.abs().amax(-1) / 127 / 2                                   # [rows, blocks]
    w = codes.double().abs().reshape(codes.shape[0], width // BLOCK, BLOCK).sum(-1)  # [out, blocks]
    quant = half_step @ w.t() * scales.double()
    exact = x.double() @ (codes.double() * scales.double()[:, None]).t()
    terms = x.double().abs() @ (codes.double().abs() * scales.double()[:, None]).t()
    quant = quant * (1 + 2 ** -7)
    return quant + (exact.abs() + quant) * 2 ** -8 + terms * 2 ** -16


@functools.cache
def kernel() -> W8A8Kernel | None:
    """The native kernel, or None when the native library cannot be built here."""
    from kvledger.engine.attention.native import library

    lib = library()
    return None if lib is None else W8A8Kernel(lib)
