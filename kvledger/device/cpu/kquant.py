"""The native products behind the ``kquant`` weight formats (``kquant_gemv.cpp``): bf16
activations times a weight held in GGUF's own blocks (Q4_K, Q5_K, Q6_K with the activations
rounded to int8 per super-block of 256 as llama.cpp's Q8_K; Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 with
the activations rounded per block of 32), and those weights dequantized to fp32 or bf16 for a
prefill's GEMM.

A weight is a list of row segments ``(type name, blocks)``, each ``blocks`` a uint8
``[rows, row bytes]`` tensor as the file stores that tensor; the product writes segment after
segment into the output's columns. Each path the library was built with (:data:`ISAS`: plain
loops, AVX2, AVX-512 BW + VNNI) can be asked for, so the kernel probe times them all. Output rows
are split over ``torch.get_num_threads()`` threads once the weight holds :data:`THREAD_BYTES`.

:func:`kernel` returns None when the native library cannot be built (``KVLEDGER_NATIVE=0``, no
compiler); :mod:`kvledger.model.kquant` then dequantizes in PyTorch.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from gguf import GGMLQuantizationType

from kvledger.device.cpu.native import DTYPE_CODES

ISAS = ("scalar", "avx2", "avx512")
"""The paths of ``kquant_gemv.cpp``, by the ``isa`` number it takes."""
THREAD_BYTES = 1 << 16
"""Weights smaller than this (bytes) run on one thread."""


class KQuantKernel:
    """ctypes wrapper of ``kvl_kquant_mm`` and ``kvl_kquant_dequant``.

    Attributes:
        isas: the paths of :data:`ISAS` this build has (this CPU runs each of them).
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i32 = ctypes.c_void_p, ctypes.c_int
        self._mm = lib.kvl_kquant_mm
        self._mm.argtypes = [ptr, i32, i32, i32, ptr, ptr, ptr, ptr, i32, i32]
        self._mm.restype = None
        self._dequant = lib.kvl_kquant_dequant
        self._dequant.argtypes = [i32, ptr, i32, i32, ptr, i32, i32]
        self._dequant.restype = None
        self._block_bytes = lib.kvl_kquant_block_bytes
        mask = lib.kvl_kquant_isas()
        self.isas = tuple(name for i, name in enumerate(ISAS) if mask >> i & 1)

    def supports(self, type_name: str) -> bool:
        """Whether the kernels take blocks of this GGML type (``"Q4_K"``, ...)."""
        return type_name in GGMLQuantizationType.__members__ and \
            self._block_bytes(int(GGMLQuantizationType[type_name])) > 0

    def bind(self, segments: list[tuple[str, torch.Tensor]], in_features: int,
             isa: str) -> KQuantWeight:
        """The product with one weight, checked once (the tensors are kept alive by it).

        Raises:
            ValueError: an unsupported type, a segment that is not contiguous uint8
                ``[rows, in / block weights * block bytes]``, or an ``isa`` not built here.
        """
        if isa not in self.isas:
            raise ValueError(f"the kquant kernel has no {isa!r} path here ({self.isas})")
        for type_name, data in segments:
            if not self.supports(type_name):
                raise ValueError(f"the kquant kernel does not take {type_name} blocks")
            ggml = GGMLQuantizationType[type_name]
            per = _block_weights(ggml)
            width = in_features // per * self._block_bytes(int(ggml))
            if (in_features % per or data.dtype != torch.uint8 or data.dim() != 2
                    or data.shape[1] != width or not data.is_contiguous()):
                raise ValueError(f"a {type_name} segment of {in_features} inputs is contiguous "
                                 f"uint8 [rows, {width}]")
        return KQuantWeight(self._mm, segments, in_features, ISAS.index(isa))

    def dequantize(self, type_name: str, data: torch.Tensor, in_features: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """[rows, in_features] in ``dtype`` (fp32, or bf16 rounded once to nearest even) of
        one segment's blocks, on all torch threads (ggml's dequantization, bit for bit in fp32).

        Raises:
            ValueError: as :meth:`bind`, or a dtype other than fp32 / bf16.
        """
        if dtype not in DTYPE_CODES:
            raise ValueError(f"kquant dequantizes to fp32 or bf16, not {dtype}")
        self.bind([(type_name, data)], in_features, self.isas[0])
        w = torch.empty(data.shape[0], in_features, dtype=dtype)
        self._dequant(int(GGMLQuantizationType[type_name]), data.data_ptr(), data.shape[0],
                      in_features, w.data_ptr(), DTYPE_CODES[dtype], torch.get_num_threads())
        return w


def _block_weights(ggml: GGMLQuantizationType) -> int:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[ggml][0]


class KQuantWeight:
    """One weight's product (:meth:`KQuantKernel.bind`): per call only x is checked."""

    def __init__(self, fn, segments: list[tuple[str, torch.Tensor]], in_features: int,
                 isa: int) -> None:
        self._fn, self._held = fn, [data for _, data in segments]
        n = len(segments)
        self._types = (ctypes.c_int * n)(*(int(GGMLQuantizationType[t]) for t, _ in segments))
        self._data = (ctypes.c_void_p * n)(*(d.data_ptr() for d in self._held))
        self._rows = (ctypes.c_int * n)(*(d.shape[0] for d in self._held))
        self.in_features, self.isa = in_features, ISAS[isa]
        self.out_features = sum(d.shape[0] for d in self._held)
        self._isa = isa
        self._threaded = sum(d.nbytes for d in self._held) >= THREAD_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, in] bf16 (made contiguous here) -> [rows, out] bf16.

        Raises:
            ValueError: x not bf16 [rows, in].
        """
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"kquant takes bf16 x [rows, {self.in_features}]")
        x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        self._fn(x.data_ptr(), x.shape[0], self.in_features, len(self._held), self._types,
                 self._data, self._rows, y.data_ptr(),
                 torch.get_num_threads() if self._threaded else 1, self._isa)
        return y


@functools.cache
def kernel() -> KQuantKernel | None:
    """The native kernel, or None when the native library cannot be built here."""
    from kvledger.device.cpu.native import library

    lib = library()
    return None if lib is None else KQuantKernel(lib)
