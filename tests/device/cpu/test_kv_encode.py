"""The native int8 / int4 block encoder, given a codec's numbers, writes the bytes IntCodec.encode
(+ OutlierKeys) computes, at the block ids given and nowhere else; the quantized store gives the
same pool with it as without it (the PyTorch fallback)."""

from __future__ import annotations

import pytest
import torch

from kvledger.device.cpu.kernels import KERNELS
from kvledger.device.cpu.kv_encode import encoder
from kvledger.engine.kv.codec_numbers import codec_numbers
from kvledger.engine.kv.codecs import Fp8Codec, IntCodec, OutlierKeys, make_codecs
from kvledger.engine.kv.quantized_store import QuantizedKVStore
from kvledger.engine.kv.rotation import hadamard

native = encoder()
pytestmark = pytest.mark.skipif(native is None, reason="native library not built")


def _blocks(n, bs, heads, dim, dtype, seed):
    """Real-looking K/V: normal values, one loud channel, one constant channel, exact ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, bs, heads, dim, generator=gen) * 3
    x[..., 5] *= 200.0  # an outlier channel of magnitude ~600
    x[..., 7] = 1.25  # constant over the block: hi == lo, the scale clamps to MIN_SCALE
    x[:, :, :, 9] = torch.arange(bs, dtype=torch.float32)[None, :, None] * 0.5  # halves: ties
    return x.to(dtype)


def _numbers(codec) -> dict:
    """The encoder's keywords for ``codec``."""
    n = codec_numbers(codec)
    return {"bits": n.bits, "group": n.group, "centred": n.centred, "min_scale": n.min_scale,
            "channels": n.channels}


def _empty_parts(codec, blocks):
    return {name: torch.zeros((blocks, *shape), dtype=dtype)
            for name, (shape, dtype) in codec.fields().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("axis,group", [("per-channel", 32), ("per-token", 32),
                                        ("per-token", 16)])
@pytest.mark.parametrize("outliers", [0, 3])
@pytest.mark.parametrize("centred", [False, True])
def test_native_encoder_writes_the_codec_bytes_at_the_given_blocks(dtype, bits, axis, group,
                                                                  outliers, centred):
    bs, heads, dim = 16, 3, 64
    codec = IntCodec(bs, heads, dim, bits, axis, group, centred)
    if outliers:
        channels = torch.tensor([[5, 1, 60], [5, 2, 33], [63, 0, 5]])[:, :outliers]
        codec = OutlierKeys(codec, channels)
    x = _blocks(2, bs, heads, dim, dtype, seed=bits + group + outliers)
    ids = torch.tensor([3, 0])
    parts = _empty_parts(codec, 5)
    assert native.encode_into(x, parts, ids, **_numbers(codec))
    want = codec.encode(x)
    assert set(want) == set(parts)
    for name, tensor in want.items():
        assert torch.equal(parts[name][ids], tensor), name
        untouched = parts[name][torch.tensor([1, 2, 4])]
        assert not untouched.any(), f"{name} written outside the given blocks"


def test_native_encoder_declines_a_dtype_it_does_not_take():
    codec = IntCodec(16, 2, 64, 8, "per-token", 32, False)
    parts = _empty_parts(codec, 2)
    x = torch.randn(1, 16, 2, 64).half()
    assert not native.encode_into(x, parts, torch.tensor([0]), **_numbers(codec))
    assert not any(t.any() for t in parts.values())


def test_the_store_encodes_fp8_in_pytorch():
    """fp8 blocks are not the encoder's: the store keeps them from it."""
    keys, values = make_codecs("fp8", 16, 2, 64, 32, "per-channel")
    store = QuantizedKVStore(1, 2, 16, 2, 64, "fp8", keys, values, torch.float32, 1, KERNELS)
    assert codec_numbers(Fp8Codec(16, 2, 64)).kind == "fp8"
    parts = _empty_parts(values, 2)
    assert not store._encode_natively(values, torch.randn(1, 16, 2, 64), parts,
                                      torch.tensor([0]))
    assert not any(t.any() for t in parts.values())


@pytest.mark.parametrize("fmt", ["int8", "int4", "int3", "int2"])
@pytest.mark.parametrize("rotated", [False, True])
def test_the_store_holds_the_same_pool_with_and_without_the_native_encoder(fmt, rotated):
    """Prefill chunks and decode steps of three sequences (blocks filling at different steps),
    with and without a Hadamard rotation of the rows."""
    bs, heads, dim, layers = 16, 2, 64, 2
    channels = torch.tensor([[[3, 40], [7, 8]], [[0, 1], [62, 63]]])
    keys, values = make_codecs(fmt, bs, heads, dim, 32, "per-channel", channels)
    stores = [QuantizedKVStore(layers, 12, bs, heads, dim, fmt, keys, values, torch.bfloat16,
                               residual_slots=3, kernels=KERNELS if flag else None,
                               rotation=hadamard(dim) if rotated else None)
              for flag in (True, False)]
    gen = torch.Generator().manual_seed(1)
    # sequence i owns blocks 4i .. 4i + 3; prompts of 21, 16 and 7 tokens, then 20 decode steps
    steps = [torch.cat([torch.arange(0, 21), torch.arange(64, 80), torch.arange(128, 135)])]
    steps += [torch.tensor([21 + t, 80 + t, 135 + t]) for t in range(20)]
    for slots in steps:
        k = torch.randn(len(slots), heads, dim, generator=gen).to(torch.bfloat16)
        v = torch.randn(len(slots), heads, dim, generator=gen).to(torch.bfloat16)
        for store in stores:
            for layer in range(layers):
                store.write(layer, slots, k * (layer + 1), v)
    fast, slow = stores
    for layer in range(layers):
        for side in ("key_parts", "value_parts"):
            for name, tensor in getattr(fast, side)[layer].items():
                assert torch.equal(tensor, getattr(slow, side)[layer][name]), (layer, side, name)
    assert torch.equal(fast.residual_of, slow.residual_of)
    assert all(torch.equal(a, b) for a, b in zip(fast.residual_keys, slow.residual_keys))
