"""The Triton KV codecs against ``engine/kv/codecs.py``: int8 / int4 / int2 (per-channel keys,
per-token value groups, centred levels) and fp8 encode to the same bytes and decode to the
same values, written at the block ids asked for. Under the interpreter on CPU tensors, or on a
GPU (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[cuda]')")

from kvledger.device.cuda.triton_kernels import kv_fp8, kv_int
from kvledger.engine.kv.codecs import MIN_SCALE, Fp8Codec, IntCodec

pytestmark = pytest.mark.triton

BS, H, D = 4, 2, 16


def _blocks(n=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, BS, H, D, generator=g) * 3
    x[0, :, 0, 5] += 40.0  # an outlier channel stretches one group's range
    x[1, :, 1] = 0.25  # a constant head: the least scale
    return x.to(dtype)


def _empty(codec, blocks: int, dev):
    return {name: torch.zeros((blocks, *shape), dtype=dtype, device=dev)
            for name, (shape, dtype) in codec.fields().items()}


INT_CASES = [(8, "per-channel", D, False), (4, "per-channel", D, False),
             (2, "per-channel", D, False), (8, "per-token", 8, False),
             (4, "per-token", 4, False), (4, "per-token", 16, False),
             (2, "per-token", 8, True), (4, "per-token", 8, True)]


@pytest.mark.parametrize("bits,axis,group,centred", INT_CASES)
def test_int_encode_writes_the_torch_codecs_bytes_at_the_block_ids(dev, bits, axis, group,
                                                                   centred):
    codec = IntCodec(BS, H, D, bits, axis, group, centred)
    x = _blocks()
    want = codec.encode(x)
    parts, ids = _empty(codec, 6, dev), torch.tensor([4, 0, 2])
    kv_int.encode_into(x.to(dev), parts, ids.to(dev), bits=bits,
                       group=0 if axis == "per-channel" else group, centred=centred,
                       min_scale=MIN_SCALE)
    for name, tensor in want.items():
        assert torch.equal(parts[name][ids].cpu(), tensor), name
    assert not parts["codes"][[1, 3, 5]].any(), "a block not asked for was written"


@pytest.mark.parametrize("bits,axis,group,centred", INT_CASES[:5])
def test_int_decode_matches_the_torch_codec(dev, bits, axis, group, centred):
    codec = IntCodec(BS, H, D, bits, axis, group, centred)
    parts = codec.encode(_blocks(seed=1))
    got = kv_int.decode({k: v.to(dev) for k, v in parts.items()}, torch.float32, bits=bits,
                        group=0 if axis == "per-channel" else group)
    torch.testing.assert_close(got.cpu(), codec.decode(parts, torch.float32), atol=1e-6,
                               rtol=1e-6)


def test_int_encode_of_bf16_blocks_and_decode_to_bf16(dev):
    codec = IntCodec(BS, H, D, 4, "per-token", 8)
    x = _blocks(dtype=torch.bfloat16, seed=2)
    parts, ids = _empty(codec, 3, dev), torch.arange(3)
    kv_int.encode_into(x.to(dev), parts, ids.to(dev), bits=4, group=8, centred=False,
                       min_scale=MIN_SCALE)
    want = codec.encode(x)
    assert all(torch.equal(parts[k].cpu(), want[k]) for k in want)
    got = kv_int.decode(parts, torch.bfloat16, bits=4, group=8)
    assert got.dtype == torch.bfloat16
    # a GPU's cast to bf16 rounds to nearest, as PyTorch's; the interpreter's truncates
    ulp = 0 if dev == "cuda" else 2 ** -7
    torch.testing.assert_close(got.cpu(), codec.decode(want, torch.bfloat16), atol=0, rtol=ulp)


def test_the_int_kernels_take_power_of_two_shapes_only():
    assert kv_int.accepts(16, 128, 4, 0) and kv_int.accepts(16, 128, 8, 32)
    assert not kv_int.accepts(16, 96, 4, 0)  # head_dim 96: the PyTorch codec encodes
    assert not kv_int.accepts(12, 128, 4, 0) and not kv_int.accepts(16, 128, 3, 0)
    assert not kv_int.accepts(16, 128, 4, 24)


def _fp8(dev, x, ids):
    codec = Fp8Codec(BS, H, D)
    parts = _empty(codec, 5, dev)
    kv_fp8.encode_into(x.to(dev), parts, ids.to(dev), min_scale=MIN_SCALE)
    return codec, codec.encode(x), {k: v[ids].cpu() for k, v in parts.items()}


def test_fp8_encode_writes_the_torch_codecs_bytes_and_decode_its_values(dev):
    codec, want, got = _fp8(dev, _blocks(seed=3), torch.tensor([3, 1, 4]))
    assert torch.equal(got["codes"], want["codes"]) and torch.equal(got["scale"], want["scale"])
    back = kv_fp8.decode({k: v.to(dev) for k, v in want.items()}, torch.float32)
    torch.testing.assert_close(back.cpu(), codec.decode(want, torch.float32), atol=0, rtol=0)


def test_fp8_saturates_a_huge_value_and_rounds_the_rest_as_subnormals(dev):
    x = _blocks(seed=4)
    x[2, 0, 1, 3] = 1e6  # the rest of the block falls to e4m3's subnormals
    _, want, got = _fp8(dev, x, torch.tensor([0, 1, 2]))
    assert got["codes"][2, 0, 1, 3] == 0x7E  # +448, not NaN
    assert torch.equal(got["codes"], want["codes"]) and torch.equal(got["scale"], want["scale"])
