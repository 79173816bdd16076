"""The native fused ops against their PyTorch formulas (kvledger.device.ops.TorchOps).

fp32: the same arithmetic in another order, within 1e-5 (relative). bf16: the native ops round
once per result and PyTorch's rounds between ops too, so within ~2 bf16 ulps (2^-7 relative).
"""

from __future__ import annotations

import pytest
import torch

from kvledger.device.cpu.fused import NativeOps, fused_ops
from kvledger.device.cpu.native import library
from kvledger.device.ops import TorchOps
from kvledger.model.layers.rotary import RotaryEmbedding

RTOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}


def _close(got, want, dtype, scale=0.0):
    """Within RTOL of each value, or of ``scale`` (the inputs' size) where terms cancel."""
    got, want = got.float(), want.float()
    return bool(((got - want).abs() <= RTOL[dtype] * (want.abs() + scale) + 1e-5).all())


@pytest.fixture(scope="module")
def native():
    lib = library()
    assert lib is not None  # g++ is part of this project's machines
    return NativeOps(lib)


def _rand(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("rows", [5, 300])  # 300: rows split over threads (PARALLEL_MIN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(native, dtype, with_delta, rows):
    h, delta, w = _rand(rows, 576, dtype=dtype), _rand(rows, 576, dtype=dtype, seed=1), \
        _rand(576, dtype=dtype, seed=2)
    want_h, want = TorchOps().add_rms_norm(h.clone(), delta if with_delta else None, w, 1e-5)
    got_h, got = native.add_rms_norm(h.clone(), delta if with_delta else None, w, 1e-5)
    assert float((got_h.float() - want_h.float()).abs().max()) == 0.0  # one rounding either way
    assert _close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_torch_on_a_strided_view(native, dtype):
    """Q and K heads inside the fused qkv rows (row stride > heads * dim), as in the model."""
    rope = RotaryEmbedding(64, 4096, 10000.0, None, dtype)
    qkv = _rand(4, 15 * 64, dtype=dtype)
    positions = torch.tensor([0, 7, 300, 6000])  # past the 4096-row table: it grows
    want = TorchOps().rope_(qkv[:, :12 * 64].view(4, 12, 64).clone(), positions, rope)
    got = native.rope_(qkv[:, :12 * 64].view(4, 12, 64), positions, rope)
    assert _close(got, want, dtype, scale=4.0)  # a cos - b sin cancels: error ~ |a| + |b|
    assert torch.equal(got, qkv[:, :12 * 64].view(4, 12, 64))  # rotated in place
    assert torch.equal(qkv[:, 12 * 64:], _rand(4, 15 * 64, dtype=dtype)[:, 12 * 64:])  # V kept


@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("rows", [3, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_mul_matches_torch(native, dtype, rows, op):
    gate_up = _rand(rows, 2 * 1536, dtype=dtype) * 4  # up to |x| ~ 20: exp's whole range used
    want, got = getattr(TorchOps(), op)(gate_up), getattr(native, op)(gate_up)
    assert _close(got, want, dtype)


def test_without_the_library_the_torch_ops_are_used(monkeypatch):
    from kvledger.device.cpu import native as builder

    monkeypatch.setenv("KVLEDGER_NATIVE", "0")
    builder.library.cache_clear()
    try:
        assert fused_ops().name == "torch"
    finally:
        builder.library.cache_clear()


@pytest.mark.parametrize("op", ["silu_mul", "gelu_tanh_mul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_glu_mul_at_the_ends_of_exp(native, dtype, op):
    """Gates far past exp's fp32 range (clamped inside the kernel): act(x) ~ x or ~ 0."""
    gate = torch.tensor([[-200.0, -90.0, -30.0, 0.0, 30.0, 90.0, 200.0, 1e-3] * 4])
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=1).to(dtype)
    assert _close(getattr(native, op)(gate_up), getattr(TorchOps(), op)(gate_up), dtype)
