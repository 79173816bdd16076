"""Weights held in a GGUF file's own blocks: the ``kquant`` weight formats.

A K-quant GGUF (Q4_K_M and the like) mixes Q4_K, Q5_K and Q6_K matrices (super-blocks of 256
weights with 6- or 8-bit sub-block scales), and sometimes Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 ones
(blocks of 32). Each matrix is kept as :class:`GGMLMatrix`: its blocks, byte for byte as the file
stores them (layouts: ggml's ``ggml-common.h``, summarised in ``csrc/kquant_blocks.h``), so the
bytes held are the file's. :class:`KQuantLinear` multiplies by one or more of them stacked by
rows (a layer's fused Q/K/V may mix types):

- ``kquant-avx512`` / ``kquant-avx2``: the native kernel's AVX-512 VNNI or AVX2 path
  (:mod:`kvledger.device.cpu.kquant`), with the activations rounded to int8 per super-block of
  256 (llama.cpp's Q8_K; per 32 for the 32-weight types), chosen by the kernel probe;
- ``kquant-torch``: the fallback where no vector path is built (``KVLEDGER_NATIVE=0``, no
  compiler, no AVX2): the weight dequantized for each call (natively where the library is
  built, else by :func:`dequantize` in PyTorch) and multiplied in fp32.

Many rows (a prefill chunk) take the GEMM path of :class:`kvledger.model.linear.Linear` on the
weight dequantized per call to bf16 or fp32 (:meth:`KQuantLinear.dense_weight`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvledger.model.linear import KQUANT_FORMATS, Linear

KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")
BLOCK_TYPES = (*KQUANT_TYPES, "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
"""The GGML types held as blocks: a K-quant file's matrices of other types are dequantized at
load (:mod:`kvledger.model.weights.gguf_tensors`)."""
NATIVE_FORMATS = {"kquant-avx512": "avx512", "kquant-avx2": "avx2"}
"""Format -> the native kernel's path (:data:`kvledger.device.cpu.kquant.ISAS`)."""


@dataclass(frozen=True)
class GGMLMatrix:
    """One matrix of a GGUF file as its blocks.

    Attributes:
        type_name: the GGML type (one of :data:`BLOCK_TYPES`).
        data: uint8 [rows, in_features / block weights * block bytes], the file's bytes.
        in_features: the matrix's columns.
    """

    type_name: str
    data: torch.Tensor
    in_features: int

    @property
    def shape(self) -> tuple[int, int]:
        """[rows, in_features] of the matrix it holds."""
        return self.data.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __getitem__(self, rows: slice | torch.Tensor) -> GGMLMatrix:
        """The matrix of the rows ``rows`` (a slice: a view; ids: a copy)."""
        return GGMLMatrix(self.type_name, self.data[rows], self.in_features)

    def columns(self, start: int, stop: int) -> GGMLMatrix | torch.Tensor:
        """Columns [start, stop): the blocks that hold them when both are block boundaries
        (a copy), else those columns dequantized to fp32."""
        per, size = GGML_QUANT_SIZES[GGMLQuantizationType[self.type_name]]
        if start % per or stop % per:
            return self.dequantize(torch.float32)[:, start:stop]
        data = self.data[:, start // per * size:stop // per * size].contiguous()
        return GGMLMatrix(self.type_name, data, stop - start)

    def dequantize(self, dtype: torch.dtype, kernels=None) -> torch.Tensor:
        """[rows, in_features] in ``dtype``: ggml's fp32 weights (the native dequantizer of the
        device's ``kernels`` where built, else :func:`dequantize`), rounded once to ``dtype``."""
        native = None if kernels is None else kernels.kquant()
        if native is not None and dtype in (torch.float32, torch.bfloat16):
            return native.dequantize(self.type_name, self.data.contiguous(), self.in_features,
                                     dtype)
        return dequantize(self.type_name, self.data).to(dtype)


def random_matrix(type_name: str, rows: int, in_features: int,
                  generator: torch.Generator | None = None) -> GGMLMatrix:
    """A matrix of random blocks of one of :data:`BLOCK_TYPES` (random codes and sub-block
    scales; every fp16 scale and minimum 2^-8, so no NaN, infinity or subnormal): weights of a
    real shape for timing and tests."""
    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = torch.randint(0, 256, (rows * (in_features // per), size), dtype=torch.uint8,
                           generator=generator)
    scale = torch.tensor([2.0 ** -8], dtype=torch.float16).view(torch.uint8)
    for at in _FP16_AT[type_name]:
        blocks[:, at:at + 2] = scale
    return GGMLMatrix(type_name, blocks.reshape(rows, -1), in_features)


_FP16_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,),
            "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2)}
"""Byte offsets of each block's fp16 scale (and minimum) per type (``csrc/kquant_blocks.h``)."""


def dequantize(type_name: str, data: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, in] of blocks ``data`` uint8 [rows, row bytes] of one of
    :data:`BLOCK_TYPES`, in PyTorch, with ggml's operations in ggml's order (so the weights
    equal ``gguf.quants.dequantize`` bit for bit)."""
    size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    rows = data.shape[0]
    b = data.reshape(-1, size)
    w = _DEQUANTIZE[type_name](b, _fp16(b, 0 if type_name != "Q6_K" else 208))
    return w.reshape(rows, -1)


def _fp16(b: torch.Tensor, at: int) -> torch.Tensor:
    """[blocks, 1] fp32 of the fp16 at byte ``at`` of each block."""
    return b[:, at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 2 n] of bytes [..., n]: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """[blocks, count] of little-endian bit fields ``qh`` [blocks, count / 8] uint8: bit i."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(-1, count)


def _q8_0(b, d):
    return b[:, 2:].contiguous().view(torch.int8).float() * d


def _q4_0(b, d):
    return d * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b, d):
    return d * _nibbles(b[:, 4:]).float() + _fp16(b, 2)


def _q5(b, at):
    return _nibbles(b[:, at + 4:]) | (_bits(b[:, at:at + 4], 32) << 4)


def _q5_0(b, d):
    return d * (_q5(b, 2).to(torch.int8) - 16).float()


def _q5_1(b, d):
    return d * _q5(b, 4).float() + _fp16(b, 2)


def _scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and minima [blocks, 8] of Q4_K / Q5_K's 12 packed bytes."""
    low, high, tail = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low & 63, (tail & 0x0F) | ((low >> 6) << 4)], dim=1)
    mins = torch.cat([high & 63, (tail >> 4) | ((high >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _q45_k(b, d, fifth: bool):
    sc, m = _scales_mins(b[:, 4:16])
    qs = b[:, 48 if fifth else 16:].reshape(-1, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)  # sub-block j = 2 c + half
    if fifth:
        q = q | (_bits(b[:, 16:48], 256).reshape(-1, 32, 8).transpose(1, 2) << 4)
    return ((d * sc)[:, :, None] * q.float() - (_fp16(b, 2) * m)[:, :, None]).reshape(-1, 256)


def _q6_k(b, d):
    ql = b[:, :128].reshape(-1, 2, 2, 32)                        # [blocks, n, c & 1, l]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)                  # [blocks, n, c, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    top = (qh >> (2 * torch.arange(4, dtype=torch.uint8))[:, None]) & 3
    q = ((low | (top << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    return ((d * scales)[:, :, None] * q).reshape(-1, 256)


_DEQUANTIZE = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
               "Q4_K": lambda b, d: _q45_k(b, d, False), "Q5_K": lambda b, d: _q45_k(b, d, True),
               "Q6_K": _q6_k}


class KQuantLinear(Linear):
    """``y = x @ W.T + b`` with W the row-concatenation of ``parts`` held as blocks.

    Args:
        parts: the matrices, all of ``in_features`` columns.
        bias: optional [out].
        fmt: one of :data:`KQUANT_FORMATS`; a native path this build lacks (or a type its
            kernel does not take) falls back along them.
        kernels: the device's native kernels (``kvledger.device.Device.kernels``); None:
            ``kquant-torch``.
    """

    def __init__(self, parts: list[GGMLMatrix], bias: torch.Tensor | None = None,
                 fmt: str = KQUANT_FORMATS[0], kernels=None) -> None:
        if fmt not in KQUANT_FORMATS:
            raise ValueError(f"a K-quant weight's format is one of {KQUANT_FORMATS}, not {fmt!r}")
        self.parts, self.bias = parts, bias
        self.out_features = sum(p.shape[0] for p in parts)
        self.weight = self.packed = self.scales = None
        self.gemm_rows: int | None = None
        self.gemm_path = "fp32"
        self.format, self._native, self.kernels = "kquant-torch", None, kernels
        native = None if kernels is None else kernels.kquant()
        for name in KQUANT_FORMATS[KQUANT_FORMATS.index(fmt):]:
            isa = NATIVE_FORMATS.get(name)
            if isa is None or native is None or isa not in native.isas \
                    or not all(native.supports(p.type_name) for p in parts):
                continue
            self._native = native.bind([(p.type_name, p.data) for p in parts],
                                       parts[0].in_features, isa)
            self.format = name
            break

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks held (the file's bytes of these matrices)."""
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, in] -> [tokens, out]: the native kernel, or (many rows, or no kernel) the
        GEMM on the weight dequantized for the call."""
        if self._native is None or (self.gemm_rows is not None and x.shape[0] >= self.gemm_rows):
            return self.gemm(x, self.gemm_path)
        y = self._native(x)
        return y if self.bias is None else y + self.bias

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] in ``dtype``, dequantized for this call (:meth:`GGMLMatrix.dequantize`)."""
        if len(self.parts) == 1:
            return self.parts[0].dequantize(dtype, self.kernels)
        return torch.cat([p.dequantize(dtype, self.kernels) for p in self.parts])

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` [T] of W as [T, in] in ``dtype`` (an embedding lookup)."""
        if len(self.parts) != 1:
            return self.dense_weight(dtype)[ids]
        return self.parts[0][ids].dequantize(dtype, self.kernels)
