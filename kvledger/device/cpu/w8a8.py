"""The native products with int8 activations behind the ``w8a8`` and ``w4a8`` weight formats
(``int8_gemv.cpp``), and their weights written out in bf16 for a prefill's GEMM
(:meth:`RepackedWeight.dense_bf16`; ``dequant_bf16.cpp``).

w8a8:

``y = kernel(x, codes, scales)`` computes, for x [rows, in] bf16, the int8 weight ``codes``
[out, in] and its fp32 ``scales`` [out, in / 32], one per block b of :data:`BLOCK` inputs (GGML's
Q8_0 layout; :func:`kvledger.model.linear.int8_blocks`),

    y[r, o] = sum_b scales[o, b] * d[r, b] * sum_{i in b} round(x[r, i] / d[r, b]) * codes[o, i]

with ``d[r, b] = max_{i in b} |x[r, i]| / 127`` (the activation quantization of GGML's Q8_0),
in bf16. Rounding x to int8 moves each input by at most ``d[r, b] / 2``, so
``|y - x @ W.T| <= sum_b d[r, b] / 2 * sum_{i in b} |W[o, i]|`` plus the bf16 rounding of y
(:func:`rounding_bound`).

w4a8 (:meth:`W8A8Kernel.bind_q4`): the weight is a GGUF Q4_0 / Q4_1 matrix as the file stores it
(4-bit codes c with a scale e and a minimum m per block of 32 inputs, ``w = e * c + m``;
:func:`kvledger.model.q4.q4_blocks`), times the same int8 activations:
``y[r, o] = sum_b d[r, b] (e[o, b] sum_{i in b} c[o, i] a[r, i] + m[o, b] sum_{i in b} a[r, i])``
(llama.cpp's Q4_1 x Q8_1 scheme), so only the activations are rounded beyond the file.

Both weights are held repacked for streaming (:mod:`kvledger.device.cpu.repack`), not as the
parts given; the products' paths (plain loops, AVX2, AVX-512 VNNI: :data:`PATHS`) give the same
bits, and :attr:`W8A8Kernel.path` is the fastest of them on this machine, measured once per
process.

Output rows are split over
``torch.get_num_threads()`` threads (OpenMP, torch's own pool) once the weight holds at least
:data:`THREAD_BYTES`, else one.

:func:`kernel` returns None when the native library cannot be built (``KVLEDGER_NATIVE=0``, no
compiler); the format then falls back to ``int8`` (PyTorch's ``_weight_int8pack_mm``).
"""

from __future__ import annotations

import ctypes
import functools
import time

import torch

from kvledger.device.cpu import repack

BLOCK = 32
THREAD_BYTES = 1 << 16
"""Weights smaller than this (bytes of codes) run on one thread."""
PATHS = {"scalar": 1, "avx2": 2, "avx512vnni": 3}
"""The products' paths, as ``kvl_w8a8_mm``'s ``path`` argument names them."""
Q8 = (BLOCK, torch.int8, 1)
Q4 = (BLOCK // 2, torch.uint8, 2)
"""A repacked weight's code bytes per row and block, their dtype and its fp32 numbers per block
(w8a8: the scale; w4a8: the scale and the minimum)."""


class W8A8Kernel:
    """ctypes wrapper of ``kvl_w8a8_mm``, ``kvl_w8a8_mm_grouped`` and ``kvl_w4a8_mm``.

    Attributes:
        paths: the paths built here (names of :data:`PATHS`).
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        product = [ptr, i32, i32, ptr, i32, ptr, i32, i32]
        self._fns = {Q8: lib.kvl_w8a8_mm, Q4: lib.kvl_w4a8_mm}
        self._dense = {Q8: lib.kvl_q8_dequant_bf16, Q4: lib.kvl_q4_dequant_bf16}
        for fn in self._fns.values():
            fn.argtypes, fn.restype = product, i32
        for fn in self._dense.values():
            fn.argtypes, fn.restype = [ptr, i32, i32, ptr, i32], None
        self._grouped = lib.kvl_w8a8_mm_grouped
        self._grouped.argtypes = [ptr, i32, i32, ptr, i32, ptr, ptr, i32, i32, ptr, i32, i32]
        self._grouped.restype = i32
        built = lib.kvl_int8_paths()
        self.paths = tuple(name for name, bit in PATHS.items() if built >> bit & 1)

    @staticmethod
    def accepts(in_features: int) -> bool:
        """Whether the kernel takes inputs of this width (whole blocks of :data:`BLOCK`)."""
        return in_features % BLOCK == 0

    def bind(self, codes: torch.Tensor, scales: torch.Tensor) -> RepackedWeight:
        """The w8a8 product with one weight: int8 ``codes`` [out, in] and fp32 block ``scales``
        [out, in / 32], both contiguous; held repacked (:func:`repack.repack`), not the parts.

        Raises:
            ValueError: a wrong dtype or layout, or ``in`` not a multiple of :data:`BLOCK`.
        """
        if (codes.dtype != torch.int8 or scales.dtype != torch.float32 or codes.dim() != 2
                or not self.accepts(codes.shape[1])
                or tuple(scales.shape) != (codes.shape[0], codes.shape[1] // BLOCK)
                or not (codes.is_contiguous() and scales.is_contiguous())):
            raise ValueError("w8a8 takes contiguous int8 codes [out, in] with in % 32 == 0 "
                             "and fp32 scales [out, in / 32]")
        return RepackedWeight(self, Q8, codes.view(codes.shape[0], -1, BLOCK), scales)

    def bind_grouped(self, weights: list[RepackedWeight]) -> W8A8Group:
        """The grouped product over ``weights`` (each bound by :meth:`bind`, all of one shape):
        the routed experts of a mixture-of-experts layer.

        Raises:
            ValueError: no weights, a w4a8 weight, or weights of different shapes.
        """
        shapes = {(w.out_features, w.in_features) for w in weights}
        if not weights or len(shapes) != 1 or any(
                not isinstance(w, RepackedWeight) or w.kind != Q8 for w in weights):
            raise ValueError("a grouped w8a8 product takes w8a8 weights of one shape")
        return W8A8Group(self._grouped, weights)

    def bind_q4(self, qs: torch.Tensor, e: torch.Tensor, m: torch.Tensor) -> RepackedWeight:
        """The w4a8 product with one Q4 weight (:func:`kvledger.model.q4.q4_blocks`): uint8
        ``qs`` [out, in / 2] in ggml's block order, fp32 scales ``e`` and minima ``m``
        [out, in / 32], all contiguous; held repacked (:func:`repack.repack`), not the parts.

        Raises:
            ValueError: a wrong dtype, shape or layout.
        """
        out, half = qs.shape if qs.dim() == 2 else (0, 0)
        blocks = (out, 2 * half // BLOCK)
        if (qs.dtype != torch.uint8 or qs.dim() != 2 or not self.accepts(2 * half)
                or any(t.dtype != torch.float32 or tuple(t.shape) != blocks for t in (e, m))
                or not all(t.is_contiguous() for t in (qs, e, m))):
            raise ValueError("w4a8 takes contiguous uint8 codes [out, in / 2] with in % 32 == 0 "
                             "and fp32 scales and minima [out, in / 32]")
        return RepackedWeight(self, Q4, qs.view(out, -1, BLOCK // 2), e, m)

    @functools.cached_property
    def path(self) -> str:
        """The fastest vector path here (they give the same bits): each built one timed on a
        1024 x 2048 w4a8 weight, one thread, best of 5 passes; ``scalar`` when none is built."""
        paths = [p for p in self.paths if p != "scalar"]
        if len(paths) < 2:
            return paths[0] if paths else "scalar"
        gen = torch.Generator().manual_seed(0)
        weight = RepackedWeight(self, Q4, torch.randint(0, 256, (1024, 64, 16), generator=gen,
                                                        dtype=torch.uint8),
                                *torch.zeros(2, 1024, 64))
        x = torch.randn(1, 2048, generator=gen).bfloat16()
        best = {}
        for path in paths:
            times = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(8):
                    weight(x, path=path)
                times.append(time.perf_counter() - t)
            best[path] = min(times)
        return min(best, key=best.get)

    def __call__(self, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                 scalar: bool = False) -> torch.Tensor:
        """``bind(codes, scales)(x, scalar)`` (see :class:`RepackedWeight`)."""
        return self.bind(codes, scales)(x, scalar)


class RepackedWeight:
    """One weight's w8a8 or w4a8 product (:meth:`W8A8Kernel.bind`, :meth:`W8A8Kernel.bind_q4`)
    on its repacked form ``packed`` (:mod:`kvledger.device.cpu.repack`); per call only x is
    checked."""

    def __init__(self, kernel: W8A8Kernel, kind: tuple, codes: torch.Tensor,
                 *floats: torch.Tensor) -> None:
        self._kernel, self.kind = kernel, kind
        self.packed = repack.repack(codes, *floats)
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * BLOCK
        self._threaded = codes.numel() >= THREAD_BYTES

    def __call__(self, x: torch.Tensor, scalar: bool = False,
                 path: str | None = None) -> torch.Tensor:
        """[rows, in] bf16 (made contiguous here) -> [rows, out] bf16 (the module docstring) on
        ``path`` (a built one of :data:`PATHS`; default :attr:`W8A8Kernel.path`; ``scalar``:
        the plain loops).

        Raises:
            ValueError: x not bf16 [rows, in], or a path not built here.
        """
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"w8a8 takes bf16 x [rows, {self.in_features}]")
        path = "scalar" if scalar else path or self._kernel.path
        if path not in self._kernel.paths:
            raise ValueError(f"path {path!r} is not built here: {self._kernel.paths}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        self._kernel._fns[self.kind](
            x.data_ptr(), x.shape[0], self.in_features, self.packed.data_ptr(), self.out_features,
            y.data_ptr(), torch.get_num_threads() if self._threaded else 1, PATHS[path])
        return y

    def blocks(self, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The parts bound of rows ``ids`` (int64; default all): w8a8 codes int8 [T, in] and
        scales [T, in / 32]; w4a8 qs uint8 [T, in / 2], e and m [T, in / 32]."""
        if ids is None:
            ids = torch.arange(self.out_features)
        n, dtype, _ = self.kind
        codes, *floats = repack.unpack(self.packed, ids, n)
        return codes.view(dtype).flatten(1), *floats

    def dense_bf16(self) -> torch.Tensor:
        """bf16 [out, in]: each weight (w8a8 ``code * s``, w4a8 ``e * code + m``) in fp32,
        rounded once to bf16 (``dequant_bf16.cpp``), on all torch threads."""
        w = torch.empty(self.out_features, self.in_features, dtype=torch.bfloat16)
        self._kernel._dense[self.kind](self.packed.data_ptr(), w.shape[0], w.shape[1],
                                       w.data_ptr(), torch.get_num_threads())
        return w


class W8A8Group:
    """The product of each group of activation rows with its own weight, of one set of w8a8
    weights of one shape (:meth:`W8A8Kernel.bind_grouped`): one native call, one quantization of
    the rows and one thread team for all groups (``kvl_w8a8_mm_grouped``)."""

    def __init__(self, fn, weights: list[RepackedWeight]) -> None:
        self._fn, self._held, self._kernel = fn, weights, weights[0]._kernel
        self.out_features, self.in_features = weights[0].out_features, weights[0].in_features
        self._table = torch.tensor([w.packed.data_ptr() for w in weights], dtype=torch.int64)
        self._threaded = weights[0]._threaded

    def __call__(self, x: torch.Tensor, experts: torch.Tensor, starts: torch.Tensor,
                 scalar: bool = False) -> torch.Tensor:
        """[rows, in] bf16 -> [rows, out] bf16: rows ``starts[g]:starts[g + 1]`` times weight
        ``experts[g]``, for ``experts`` int64 [groups] and ``starts`` int64 [groups + 1]
        (non-decreasing, from 0 to rows); ``scalar`` as :meth:`RepackedWeight.__call__`.

        Raises:
            ValueError: x not bf16 [rows, in]; ``experts`` or ``starts`` of another dtype or
                length, or out of range.
        """
        rows = x.shape[0] if x.dim() == 2 else -1
        if x.dtype != torch.bfloat16 or rows < 0 or x.shape[1] != self.in_features:
            raise ValueError(f"w8a8 takes bf16 x [rows, {self.in_features}]")
        groups = experts.numel()
        if (experts.dtype != torch.int64 or starts.dtype != torch.int64
                or starts.shape != (groups + 1,)):
            raise ValueError("grouped w8a8 takes int64 experts [groups] and starts [groups + 1]")
        x, experts, starts = x.contiguous(), experts.contiguous(), starts.contiguous()
        y = torch.empty(rows, self.out_features, dtype=torch.bfloat16)
        path = PATHS["scalar" if scalar else self._kernel.path]
        if self._fn(x.data_ptr(), rows, self.in_features, self._table.data_ptr(),
                    len(self._held), experts.data_ptr(), starts.data_ptr(), groups,
                    self.out_features, y.data_ptr(),
                    torch.get_num_threads() if self._threaded else 1, path) != 0:
            raise ValueError(f"grouped w8a8: experts must lie in [0, {len(self._held)}) and "
                             f"starts rise from 0 to the {rows} rows")
        return y


def rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[rows, out] fp64 bound on ``|product(x) - x @ weight.T|`` in exact arithmetic, for either
    kernel with ``weight`` [out, in] its weight as stored (w8a8: ``codes * scales[:, None]``;
    w4a8: the dequantized Q4 blocks): each input's int8 rounding (at most ``d / 2`` per block)
    times the weights it meets (with a 2^-7 relative margin for the fp32 block scales), plus the
    output's bf16 rounding (half an ulp: 2^-8 relative), plus fp32 summation (2^-16 of the sum
    of |terms|, more than the ~50 fp32 additions of a row can lose)."""
    rows, width = x.shape
    xb = x.double().reshape(rows, width // BLOCK, BLOCK)
    half_step = xb.abs().amax(-1) / 127 / 2                                   # [rows, blocks]
    w = weight.double()
    blocks = w.abs().reshape(w.shape[0], width // BLOCK, BLOCK).sum(-1)       # [out, blocks]
    quant = half_step @ blocks.t() * (1 + 2 ** -7)
    exact = x.double() @ w.t()
    terms = x.double().abs() @ w.abs().t()
    return quant + (exact.abs() + quant) * 2 ** -8 + terms * 2 ** -16


@functools.cache
def kernel() -> W8A8Kernel | None:
    """The native kernel, or None when the native library cannot be built here."""
    from kvledger.device.cpu.native import library

    lib = library()
    return None if lib is None else W8A8Kernel(lib)
