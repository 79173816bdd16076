"""Weights held as a GGUF's blocks (``kvledger.model.kquant``): the PyTorch dequantization
against the ``gguf`` library (an independent implementation of ggml's formats), and the
``kquant-torch`` fallback and GEMM path of :class:`KQuantLinear` against an fp64 product on
those weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvledger.device.cpu.kernels import KERNELS
from kvledger.model import kquant
from kvledger.model.kquant import BLOCK_TYPES, GGMLMatrix, KQuantLinear, random_matrix
from kvledger.model.linear import Linear


def _reference(m: GGMLMatrix) -> torch.Tensor:
    array = gguf_dequantize(m.data.numpy(), GGMLQuantizationType[m.type_name])
    return torch.from_numpy(np.asarray(array, dtype=np.float32).reshape(m.shape))


@pytest.fixture
def no_native(monkeypatch):
    """The native kernels off, as without a compiler."""
    monkeypatch.setattr(KERNELS, "kquant", lambda: None)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_pytorch_dequantization_is_ggml_bit_for_bit(type_name):
    m = random_matrix(type_name, 9, 512, torch.Generator().manual_seed(3))
    scale_free = m.data.clone()  # and any finite fp16 scale and minimum, of either sign
    size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    blocks = scale_free.view(-1, size)
    offsets = kquant._FP16_AT[type_name]
    values = (torch.randn(blocks.shape[0], len(offsets),
                          generator=torch.Generator().manual_seed(4)) * 0.01).half()
    for i, at in enumerate(offsets):
        blocks[:, at:at + 2] = values[:, i].contiguous().view(torch.uint8).view(-1, 2)
    for case in (m, GGMLMatrix(type_name, scale_free, 512)):
        assert torch.equal(kquant.dequantize(type_name, case.data), _reference(case))


def test_the_fallback_equals_the_fp64_product(no_native):
    """kquant-torch: the weight dequantized for the call, multiplied in fp32, rounded to bf16."""
    parts = [random_matrix("Q4_K", 24, 512, torch.Generator().manual_seed(0)),
             random_matrix("Q6_K", 8, 512, torch.Generator().manual_seed(1))]
    lin = KQuantLinear(parts, fmt="kquant-avx512", kernels=KERNELS)
    assert lin.format == "kquant-torch"
    x = torch.randn(3, 512).bfloat16()
    w = torch.cat([_reference(p) for p in parts]).double()
    exact = x.double() @ w.t()
    slack = exact.abs() * 2 ** -8 + (x.double().abs() @ w.abs().t()) * 2 ** -20
    assert ((lin(x).double() - exact).abs() <= slack).all()
    assert torch.equal(lin.rows(torch.tensor([30, 2]), torch.float32),
                       w[[30, 2]].float())


def test_many_rows_take_the_gemm_on_the_dequantized_weight():
    m = random_matrix("Q5_K", 16, 256, torch.Generator().manual_seed(2))
    lin = KQuantLinear([m], bias=torch.arange(16.0).bfloat16(), kernels=KERNELS)
    lin.use_gemm(4, "fp32")
    x = torch.randn(5, 256).bfloat16()
    expected = (torch.nn.functional.linear(x.float(), _reference(m)) + torch.arange(16.0))
    torch.testing.assert_close(lin(x).float(), expected.bfloat16().float(), rtol=2 ** -7,
                               atol=1e-5)


def test_a_native_format_is_held_where_built():
    native = KERNELS.kquant()
    if native is None:
        pytest.skip("no native library here")
    m = random_matrix("Q4_K", 8, 256)
    expected = "kquant-avx512" if "avx512" in native.isas else \
        "kquant-avx2" if "avx2" in native.isas else "kquant-torch"
    assert KQuantLinear([m], kernels=KERNELS).format == expected
    assert KQuantLinear([m], kernels=KERNELS).nbytes == m.data.nbytes == 8 * 144


def test_a_dense_weight_asked_for_a_kquant_format_stays_dense():
    dense = Linear(torch.randn(4, 256).bfloat16(), fmt="kquant-avx2", kernels=KERNELS)
    assert dense.format == "dense"
    with pytest.raises(ValueError, match="K-quant weight's format"):
        KQuantLinear([random_matrix("Q4_K", 4, 256)], fmt="int8", kernels=KERNELS)
