"""Linear layers whose weight is held in exactly one format, chosen per shape class.

Formats (names used by the kernel probe, :mod:`kvledger.engine.kernels`):

- ``dense``: the [out, in] matrix in the compute dtype (``F.linear``; oneDNN / MKL);
- ``int4``: a GGUF Q4_0/Q4_1 matrix kept packed for PyTorch's CPU int4 weight-only kernel
  (``aten._weight_int4pack_mm_for_cpu``, group size 32) with bf16 scales and zeros
  ``w = (q - 8) * scale + zero`` (:mod:`kvledger.engine.q4`); only for weights the GGUF stores
  as Q4, so it adds no rounding beyond the file's (except the scales' last 3 fp16 bits);
- ``int8``: symmetric per-row int8, ``w = q * s_row`` with ``s_row = max|w_row| / 127``
  (``aten._weight_int8pack_mm``): rounds each weight to within ``s_row / 2``;
- ``w8a8``: the same codes with fp32 row scales, multiplied by the native int8 x int8 kernel
  (:mod:`kvledger.engine.w8a8`), which also rounds the activations to int8 per block of 32
  inputs; without the native library it is ``int8``.

The quantized formats take bf16 activations only; in fp32 (the exact mode) every layer is
dense. A layer never keeps a second copy of its weight. The weight-only kernels are made for
the few rows of a decode step; on the hundreds of a prefill chunk a plain fp32 GEMM on the
weight dequantized for the call is faster on CPUs without native bf16 matmul (measured: 30 ms
against 60 ms for a [3072, 576] int8 weight at 512 rows on a 2-core AMD EPYC), so a ``dense``
or ``int8`` layer takes that path from ``gemm_rows`` rows on, a number the kernel probe
measures per shape class (:func:`kvledger.engine.kernels.probe`). ``int4`` keeps no codes it
could dequantize and always runs its kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvledger.engine import w8a8
from kvledger.engine.q4 import GROUP

FORMATS = ("dense", "int4", "int8", "w8a8")


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


def w8a8_ok(in_features: int) -> bool:
    """Whether the native ``w8a8`` kernel is built here and takes inputs of this width."""
    kernel = w8a8.kernel()
    return kernel is not None and kernel.accepts(in_features)


def int8_rows(weight: torch.Tensor, chunk_rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of ``weight`` [out, in]: codes int8 [out, in], scales fp32 [out].

    Done ``chunk_rows`` rows at a time, so no fp32 copy of a whole large matrix (an embedding)
    is ever held.
    """
    codes = torch.empty(weight.shape, dtype=torch.int8)
    scale = torch.empty(weight.shape[0], dtype=torch.float32)
    for first in range(0, weight.shape[0], chunk_rows):
        w = weight[first:first + chunk_rows].float()
        s = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes[first:first + chunk_rows] = torch.round(w / s[:, None]).clamp_(-127, 127)
        scale[first:first + chunk_rows] = s
    return codes, scale


class Linear:
    """``y = x @ W.T + b`` with W in one of :data:`FORMATS`.

    Args:
        weight: dense [out, in] matrix (the compute dtype).
        bias: optional [out].
        q4: optional (q uint8 [out, in], scale [out, in/32], zero [out, in/32]) of the same W,
            needed for ``int4``.
        fmt: the format to keep; ``int4`` without ``q4`` or of a shape the kernel does not
            take (:func:`int4_shape_ok`), ``int8`` of an input width torch's kernel does not
            take (:func:`int8_shape_ok`), or any quantized format with a non-bf16 weight, falls
            back to ``dense``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 fmt: str = "dense") -> None:
        if fmt not in FORMATS:
            raise ValueError(f"weight format must be one of {FORMATS}, got {fmt!r}")
        if weight.dtype != torch.bfloat16 or (fmt == "int4" and (
                q4 is None or not int4_shape_ok(*weight.shape))):
            fmt = "dense"
        if fmt == "w8a8" and not w8a8_ok(weight.shape[1]):
            fmt = "int8"
        if fmt == "int8" and not int8_shape_ok(weight.shape[1]):
            fmt = "dense"
        self.format, self.bias, self.out_features = fmt, bias, weight.shape[0]
        self.weight = self.packed = self.scales = None
        self.gemm_rows: int | None = None  # from this many rows on: fp32 GEMM (not for int4)
        if fmt == "dense":
            self.weight = weight
        elif fmt == "int4":
            self._pack_q4(q4)
        else:
            self.packed, scale = int8_rows(weight)
            self.scales = scale if fmt == "w8a8" else scale.to(torch.bfloat16)
            self._row_scales = scale
            if fmt == "w8a8":
                self._w8a8 = w8a8.kernel().bind(self.packed, self.scales)

    @classmethod
    def from_q4(cls, q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                shape: tuple[int, int], bias: torch.Tensor | None = None) -> Linear:
        """An ``int4`` Linear of ``shape`` [out, in] from its Q4 parts alone (no dense W read).

        Raises:
            ValueError: the kernel does not take the shape (:func:`int4_shape_ok`).
        """
        if not int4_shape_ok(*shape):
            raise ValueError(f"the int4 kernel does not take a {list(shape)} weight")
        self = cls.__new__(cls)
        self.format, self.bias, self.out_features = "int4", bias, shape[0]
        self.weight, self.gemm_rows = None, None
        self._pack_q4(q4)
        return self

    def _pack_q4(self, q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        q, scale, zero = q4
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.to(torch.int32).contiguous(), 1)
        self.scales = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight (and its scales)."""
        parts = [self.weight, self.packed, self.scales]
        return sum(t.nbytes for t in parts if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, in] -> [tokens, out]."""
        if self.gemm_rows is not None and x.shape[0] >= self.gemm_rows:
            return self.fp32_gemm(x)
        if self.format == "dense":
            return F.linear(x, self.weight, self.bias)
        if self.format == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales)
        elif self.format == "w8a8":
            y = self._w8a8(x)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scales)
        return y if self.bias is None else y + self.bias

    def fp32_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, in] -> [tokens, out] in x's dtype, multiplied in fp32 on the weight
        dequantized for this call (int8, w8a8: ``(x @ q.T) * s_row`` with the kernel's
        scales, so both paths use the same weight; w8a8 does not round x here).

        Raises:
            ValueError: an ``int4`` layer (its packed codes cannot be read back).
        """
        if self.format == "int4":
            raise ValueError("an int4-packed weight has no fp32 path")
        if self.format == "dense":
            y = F.linear(x.float(), self.weight.float())
        else:
            y = F.linear(x.float(), self.packed.float()) * self.scales.float()
        y = y if self.bias is None else y + self.bias.float()
        return y.to(x.dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [T] of W as [T, in] in ``dtype`` (an embedding lookup of a tied head).

        Raises:
            ValueError: the weight is packed as int4 (rows cannot be read back).
        """
        if self.format == "dense":
            return F.embedding(ids, self.weight)
        if self.format in ("int8", "w8a8"):
            return (self.packed[ids].to(torch.float32) * self._row_scales[ids, None]).to(dtype)
        raise ValueError("rows of an int4-packed weight cannot be read back")
