"""Linear layers whose weight is held in exactly one format, chosen per shape class.

Formats (names used by the kernel probe, :mod:`kvledger.engine.tuning.probe`):

- ``dense``: the [out, in] matrix in the compute dtype (``F.linear``; oneDNN / MKL);
- ``int4``: a GGUF Q4_0/Q4_1 matrix kept packed for PyTorch's CPU int4 weight-only kernel
  (``aten._weight_int4pack_mm_for_cpu``, group size 32) with bf16 scales and zeros
  ``w = (q - 8) * scale + zero`` (:mod:`kvledger.model.q4`); only for weights the GGUF stores
  as Q4, so it adds no rounding beyond the file's (except the scales' last 3 fp16 bits);
- ``int8``: symmetric per-row int8, ``w = q * s_row`` with ``s_row = max|w_row| / 127``
  (``aten._weight_int8pack_mm``, or the device's own product, ``Kernels.int8_weights``: the
  CUDA device's Triton kernel): rounds each weight to within ``s_row / 2``;
- ``w8a8``: symmetric int8 per block of 32 inputs with fp32 scales (GGML's Q8_0 layout, so a
  Q8_0 tensor of the file keeps its codes: :func:`int8_blocks`), repacked at load like ``w4a8``
  below and multiplied by the native int8 x int8 kernel (:mod:`kvledger.device.cpu.w8a8`), which
  also rounds the activations to int8 per block of 32 inputs; without the native library it is
  ``int8``;
- ``w4a8``: a GGUF Q4_0/Q4_1 matrix in the file's own blocks (4-bit codes, fp32 scale and
  minimum per 32 weights; :func:`kvledger.model.q4.q4_blocks`), repacked at load into groups
  of 8 rows with the scales inline (:mod:`kvledger.device.cpu.repack`) and multiplied by the
  native kernel with the activations rounded to int8 per block of 32 (llama.cpp's Q4 x Q8
  scheme): no weight rounding beyond the file's; without the native library it is ``int4``;
- ``kquant-avx512``, ``kquant-avx2``, ``kquant-torch``: a K-quant GGUF's matrices in the file's
  own blocks (:mod:`kvledger.model.kquant`, which subclasses :class:`Linear`).

The quantized formats take bf16 activations only; in fp32 (the exact mode) every layer is
dense. A layer never keeps a second copy of its weight. The weight-only kernels are made for
the few rows of a decode step; on the hundreds of a prefill chunk a plain GEMM on the weight
dequantized for the call is faster (:meth:`Linear.gemm`, one of :data:`GEMM_PATHS`): ``fp32``
on CPUs without native bf16 matmul (measured: 30 ms against 60 ms for a [3072, 576] int8 weight
at 512 rows on a 2-core AMD EPYC Zen 1), ``bf16`` (oneDNN) where the CPU multiplies bf16
natively (AVX512-BF16, AMX). A layer takes its ``gemm_path`` from ``gemm_rows`` rows on, both
chosen per shape class by the kernel probe (:func:`kvledger.engine.tuning.probe.probe`).
``int4`` keeps no codes it could dequantize and always runs its kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvledger.model.q4 import GROUP, q4_blocks, q4_dequantize

KQUANT_FORMATS = ("kquant-avx512", "kquant-avx2", "kquant-torch")
"""The formats of a weight held as a GGUF's blocks (:class:`kvledger.model.kquant.KQuantLinear`);
a dense weight asked for one is ``dense``."""
FORMATS = ("dense", "int4", "int8", "w8a8", "w4a8", *KQUANT_FORMATS)
Q4_FORMATS = ("int4", "w4a8")
"""The formats that need a weight the GGUF stores as Q4."""
GEMM_PATHS = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The many-row paths of :meth:`Linear.gemm`: the dtype the product is computed in."""


def int4_shape_ok(out_features: int, in_features: int) -> bool:
    """Whether torch's CPU int4 kernel takes a weight of ``[out_features, in_features]``: it
    packs rows in tiles of 16 and needs whole groups of ``GROUP`` along the input."""
    return out_features % 16 == 0 and in_features % GROUP == 0


def int8_shape_ok(in_features: int) -> bool:
    """Whether torch's CPU int8 weight-only kernel (``_weight_int8pack_mm``) takes inputs of
    this width: torch 2.13's AVX-512 path reads them in vectors of 16 and crashes the process
    on other widths (segfault measured with 8, 24, 40, 56 and 72 on an AMD EPYC Zen 4; 16, 32,
    48 and 64 fine), so only multiples of 16 are given to it."""
    return in_features % 16 == 0


def w8a8_ok(in_features: int, kernels) -> bool:
    """Whether the device's ``kernels`` (``kvledger.device.Device.kernels``; None: none) have
    the native ``w8a8`` kernel built and it takes inputs of this width."""
    kernel = None if kernels is None else kernels.w8a8()
    return kernel is not None and kernel.accepts(in_features)


def int8_rows(weight: torch.Tensor, chunk_rows: int = 1024, block: int | None = None,
              release: Callable[[torch.Tensor], None] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of ``weight`` [out, in], per row: codes int8 [out, in], scales fp32 [out]
    (``s = max |w| / 127``); or with ``block`` per block of that many inputs (:func:`int8_blocks`).

    Done ``chunk_rows`` rows at a time, so no fp32 copy of a whole large matrix (an embedding)
    is ever held; ``release``, if given, is called with each chunk of ``weight`` (a view) once
    it is read, so a memory-mapped source
    (:class:`~kvledger.model.weights.loader.MappedWeights`) gives its pages back as it goes
    rather than being resident in full beside the codes.
    """
    out, width = weight.shape
    group = width if block is None else block
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(out, width // group, dtype=torch.float32)
    for first in range(0, out, chunk_rows):
        w = weight[first:first + chunk_rows].float().reshape(-1, width // group, group)
        s = (w.abs().amax(dim=-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes[first:first + chunk_rows] = torch.round(w / s[..., None]).clamp_(-127, 127).reshape(
            -1, width)
        scale[first:first + chunk_rows] = s
        if release is not None:
            release(weight[first:first + chunk_rows])
    return codes, (scale[:, 0] if block is None else scale)


def int8_blocks(weight: torch.Tensor, release: Callable[[torch.Tensor], None] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 of ``weight`` [out, in] per block of 32 inputs (GGML's Q8_0 scheme):
    codes int8 [out, in], scales fp32 [out, in / 32] with ``s = max |w_block| / 127``. A weight
    the file stores as Q8_0 gets its own codes back (the round trip through bf16 moves a value by
    at most 2^-9 of it, under half a code step for codes up to 127). ``release``: as in
    :func:`int8_rows`."""
    return int8_rows(weight, block=GROUP, release=release)


class Linear:
    """``y = x @ W.T + b`` with W in one of :data:`FORMATS`.

    Args:
        weight: dense [out, in] matrix (the compute dtype).
        bias: optional [out].
        q4: optional (q uint8 [out, in], scale [out, in/32], zero [out, in/32]) of the same W,
            needed for ``int4`` and ``w4a8``.
        fmt: the format to keep; ``int4`` without ``q4`` or of a shape the kernel does not
            take (:func:`int4_shape_ok`), ``int8`` of an input width torch's kernel does not
            take (:func:`int8_shape_ok`), or any quantized format with a non-bf16 weight, falls
            back to ``dense``; ``w4a8`` without the native kernel (:func:`w8a8_ok`) is ``int4``.
        release: for ``int8`` / ``w8a8``, called with each chunk of ``weight`` once quantized
            (:func:`int8_rows`); the caller must not need those rows of ``weight`` again.
        kernels: the device's native kernels (``kvledger.device.Device.kernels``); None: the
            PyTorch paths only.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 fmt: str = "dense",
                 release: Callable[[torch.Tensor], None] | None = None,
                 kernels=None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"weight format must be one of {FORMATS}, got {fmt!r}")
        if fmt in KQUANT_FORMATS:
            fmt = "dense"
        self.kernels = kernels
        if fmt == "w4a8" and (q4 is None or not w8a8_ok(weight.shape[1], kernels)):
            fmt = "int4"
        if weight.dtype != torch.bfloat16 or (fmt == "int4" and (
                q4 is None or not int4_shape_ok(*weight.shape))):
            fmt = "dense"
        if fmt == "w8a8" and not w8a8_ok(weight.shape[1], kernels):
            fmt = "int8"
        if fmt == "int8" and not int8_shape_ok(weight.shape[1]):
            fmt = "dense"
        self.format, self.bias, self.out_features = fmt, bias, weight.shape[0]
        self.weight = self.packed = self.scales = None
        self.gemm_rows: int | None = None  # from this many rows on: gemm_path (use_gemm)
        self.gemm_path = "fp32"
        if fmt == "dense":
            self.weight = weight
        elif fmt in Q4_FORMATS:
            self._pack_q4(q4)
        elif fmt == "w8a8":
            self._native = kernels.w8a8().bind(*int8_blocks(weight, release))
            self.packed = self._native.packed  # repacked (kvledger.device.cpu.repack)
        else:
            self.packed, scale = int8_rows(weight, release=release)
            self.scales, self._row_scales = scale.to(torch.bfloat16), scale
            self._int8_product = None if kernels is None else kernels.int8_weights()

    @classmethod
    def from_q4(cls, q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                shape: tuple[int, int], bias: torch.Tensor | None = None,
                fmt: str = "int4", kernels=None) -> Linear:
        """An ``int4`` or ``w4a8`` Linear of ``shape`` [out, in] from its Q4 parts alone (no
        dense W read); ``w4a8`` without the native kernel is ``int4``.

        Raises:
            ValueError: ``fmt`` not a Q4 format, or no kernel of it takes the shape
                (:func:`w8a8_ok`, :func:`int4_shape_ok`).
        """
        if fmt == "w4a8" and not w8a8_ok(shape[1], kernels):
            fmt = "int4"
        if fmt not in Q4_FORMATS or (fmt == "int4" and not int4_shape_ok(*shape)):
            raise ValueError(f"no {fmt} kernel takes a {list(shape)} weight")
        self = cls.__new__(cls)
        self.format, self.kernels = fmt, kernels
        self.bias, self.out_features = bias, shape[0]
        self.weight, self.gemm_rows, self.gemm_path = None, None, "fp32"
        self._pack_q4(q4)
        return self

    def _pack_q4(self, q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        q, scale, zero = q4
        if self.format == "w4a8":  # held repacked by the kernel (kvledger.device.cpu.repack)
            self._native = self.kernels.w8a8().bind_q4(*q4_blocks(q, scale, zero))
            self.packed, self.scales = self._native.packed, None
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 1)
        self.scales = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    def use_gemm(self, rows: int, path: str) -> None:
        """Multiply batches of ``rows`` rows or more by :meth:`gemm` on ``path``
        (:data:`GEMM_PATHS`). An ``int4`` layer keeps its own kernel at every row count: its
        packed codes cannot be read back (a ``w4a8`` choice of the probe lands here as ``int4``
        when the native kernel is off, ``KVLEDGER_NATIVE=0`` or no compiler).

        Raises:
            ValueError: ``path`` not in :data:`GEMM_PATHS`.
        """
        if path not in GEMM_PATHS:
            raise ValueError(f"GEMM path must be one of {tuple(GEMM_PATHS)}, got {path!r}")
        if self.format != "int4":
            self.gemm_rows, self.gemm_path = rows, path

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight (and its scales)."""
        parts = [self.weight, self.packed, self.scales]
        return sum(t.nbytes for t in parts if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, in] -> [tokens, out]."""
        if self.gemm_rows is not None and x.shape[0] >= self.gemm_rows:
            return self.gemm(x, self.gemm_path)
        if self.format == "dense":
            return F.linear(x, self.weight, self.bias)
        if self.format == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales)
        elif self.format in ("w8a8", "w4a8"):
            y = self._native(x)
        elif self._int8_product is not None:  # the device's own (the CUDA device's Triton)
            y = self._int8_product(x, self.packed, self._row_scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scales)
        return y if self.bias is None else y + self.bias

    def gemm(self, x: torch.Tensor, path: str) -> torch.Tensor:
        """[tokens, in] -> [tokens, out] in x's dtype, multiplied in ``path``'s dtype
        (:data:`GEMM_PATHS`) on :meth:`dense_weight` (so every path uses the layer's own
        weight; the native formats do not round x here).

        Raises:
            ValueError: an ``int4`` layer (its packed codes cannot be read back).
        """
        dtype = GEMM_PATHS[path]
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x.to(dtype), self.dense_weight(dtype), bias).to(x.dtype)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] in ``dtype``, dequantized for this call (int8: codes x the kernel's row
        scales; w8a8: codes x block scales; w4a8: the Q4 blocks; each weight computed in fp32
        and rounded once to ``dtype``; in bf16 by the native kernel where it is built).

        Raises:
            ValueError: an ``int4`` layer (its packed codes cannot be read back).
        """
        if self.format == "int4":
            raise ValueError("an int4-packed weight cannot be read back")
        if self.format == "dense":
            return self.weight.to(dtype)
        native = self.kernels.w8a8() if self.kernels and dtype == torch.bfloat16 else None
        if self.format in ("w4a8", "w8a8"):
            if native is not None:
                return self._native.dense_bf16()
            if self.format == "w4a8":
                return q4_dequantize(*self._native.blocks()).to(dtype)
            return self._dequantized_blocks(*self._native.blocks()).to(dtype)
        return (self.packed.float() * self.scales.float()[:, None]).to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [T] of W as [T, in] in ``dtype`` (an embedding lookup of a tied head).

        Raises:
            ValueError: the weight is packed as int4 (rows cannot be read back).
        """
        if self.format == "dense":
            return F.embedding(ids, self.weight)
        if self.format == "int8":
            return (self.packed[ids].to(torch.float32) * self._row_scales[ids, None]).to(dtype)
        if self.format == "w8a8":
            return self._dequantized_blocks(*self._native.blocks(ids)).to(dtype)
        if self.format == "w4a8":
            return q4_dequantize(*self._native.blocks(ids)).to(dtype)
        raise ValueError("rows of an int4-packed weight cannot be read back")

    @staticmethod
    def _dequantized_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """fp32 [n, in] of w8a8 codes [n, in] with block scales [n, in / 32]."""
        blocks = codes.view(codes.shape[0], -1, GROUP).float() * scales[..., None]
        return blocks.reshape(codes.shape)
