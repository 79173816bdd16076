"""One suite over every KV codec: declared fields, round-trip error bounds, outlier channels.

Bounds are the formats' own: asymmetric int of b bits errs by at most half a step
((max - min) / (2^b - 1) / 2, plus fp16 rounding of the zero point); fp8 e4m3 keeps 3 mantissa
bits (relative error <= 2^-4, plus half the subnormal step 2^-9 x scale near zero).
"""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.kv.codecs import Fp8Codec, IntCodec, OutlierKeys
from kvledger.errors import InvalidParameterError

BS, H, D = 16, 2, 64


def _codecs():
    outliers = torch.tensor([[3, 40], [7, 8]])
    return {
        "int8/per-channel": IntCodec(BS, H, D, 8, "per-channel", 32),
        "int8/per-token": IntCodec(BS, H, D, 8, "per-token", 32),
        "int4/per-channel": IntCodec(BS, H, D, 4, "per-channel", 32),
        "int4/per-token": IntCodec(BS, H, D, 4, "per-token", 16),
        "int3/per-channel": IntCodec(BS, H, D, 3, "per-channel", 32),
        "int3/per-token": IntCodec(BS, H, D, 3, "per-token", 32),
        "int2/per-channel": IntCodec(BS, H, D, 2, "per-channel", 32),
        "int2/per-token": IntCodec(BS, H, D, 2, "per-token", 16),
        "int2/per-token/centred": IntCodec(BS, H, D, 2, "per-token", 16, centred=True),
        "fp8": Fp8Codec(BS, H, D),
        "int4/per-channel+outliers": OutlierKeys(IntCodec(BS, H, D, 4, "per-channel", 32),
                                                 outliers),
    }


CODECS = _codecs()


def _blocks(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, BS, H, D, generator=g) * 2 + 0.5


def _bound(codec, x):
    """Largest error the format allows at each element of x [n, BS, H, D]."""
    if isinstance(codec, OutlierKeys):
        body = x.scatter(-1, codec._index(x), 0.0)
        bound = _bound(codec.inner, body)
        return bound.scatter(-1, codec._index(x), x.gather(-1, codec._index(x)).abs() * 2**-11)
    if isinstance(codec, Fp8Codec):
        scale = x.abs().amax(dim=(1, 3), keepdim=True) / 448
        return x.abs() * 2**-4 + scale * 2**-9
    g = codec._grouped(x)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = (hi - lo) / (2 ** codec.bits if codec.centred else codec.qmax)
    return codec._ungrouped((step * 0.5 * 1.01 + lo.abs() * 2**-10).expand_as(g))


@pytest.mark.parametrize("name", CODECS)
def test_fields_declare_what_encode_returns(name):
    codec = CODECS[name]
    parts = codec.encode(_blocks(3))
    assert set(parts) == set(codec.fields())
    for field, (shape, dtype) in codec.fields().items():
        assert parts[field].shape == (3, *shape) and parts[field].dtype == dtype, field


@pytest.mark.parametrize("name", CODECS)
def test_round_trip_within_the_format_bound(name):
    codec, x = CODECS[name], _blocks()
    out = codec.decode(codec.encode(x), torch.float32)
    assert out.shape == x.shape
    err = (out - x).abs()
    assert (err <= _bound(codec, x)).all(), float((err - _bound(codec, x)).max())
    assert err.max() > 0  # it does quantize


def test_int4_packs_two_codes_per_byte():
    codec = CODECS["int4/per-token"]
    assert codec.fields()["codes"][0] == (BS, H, D // 2)


@pytest.mark.parametrize("bits, row", [
    # channels 0..7 hold codes 1..7, 0 (int3) or 1, 2, 3, 0, ... (int2), written out by hand
    (3, [0b11010001, 0b01011000, 0b00011111]),  # 1 | 2<<3 | 3<<6 ... as one 24-bit word
    (2, [0b00111001, 0b00111001]),  # 1 | 2<<2 | 3<<4 | 0<<6, twice
])
def test_int3_and_int2_pack_eight_codes_in_three_and_two_bytes(bits, row):
    from kvledger.engine.kv.codecs import pack, unpack

    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]] if bits == 3 else [[1, 2, 3, 0] * 2],
                         dtype=torch.uint8)
    assert pack(codes, bits).tolist() == [row]
    assert torch.equal(unpack(pack(codes, bits), bits), codes)
    codec = IntCodec(BS, H, D, bits, "per-token", 32)
    assert codec.fields()["codes"][0] == (BS, H, D * bits // 8)


def test_outlier_channels_come_back_at_fp16_precision():
    codec, x = CODECS["int4/per-channel+outliers"], _blocks()
    out = codec.decode(codec.encode(x), torch.float32)
    idx = codec._index(x)
    assert torch.equal(out.gather(-1, idx), x.gather(-1, idx).half().float())


def test_fp8_clamps_a_huge_channel_instead_of_overflowing():
    x = _blocks()
    x[..., 5] = 600.0  # beyond e4m3's 448 before scaling
    codec = CODECS["fp8"]
    out = codec.decode(codec.encode(x), torch.float32)
    assert torch.isfinite(out).all()
    assert (out[..., 5] - 600).abs().max() <= 600 * 2**-4


def test_per_channel_keys_survive_an_outlier_channel_per_token_keys_do_not():
    """KIVI's finding (and transformers #35185): one key channel of large magnitude makes
    per-token int4 groups coarse for every channel; per-channel groups keep the attention
    output close."""
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(8, BS, H, D, generator=g)
    keys[..., 11] *= 40  # a fixed outlier channel
    values = torch.randn(8, BS, H, D, generator=g)
    q = torch.randn(H, D, generator=g)
    q[:, 11] = 0.05  # the outlier channel still adds to the scores, not dominating them

    def attention(k):
        scores = torch.einsum("hd,nthd->hnt", q, k).reshape(H, -1) / D ** 0.5
        return torch.einsum("hl,lhd->hd", scores.softmax(-1), values.reshape(-1, H, D))

    exact = attention(keys)
    errors = {}
    for axis in ("per-channel", "per-token"):
        codec = IntCodec(BS, H, D, 4, axis, 32)
        approx = attention(codec.decode(codec.encode(keys), torch.float32))
        errors[axis] = float((approx - exact).norm() / exact.norm())
    assert errors["per-channel"] < 0.1
    assert errors["per-token"] > 3 * errors["per-channel"], errors


def test_bad_layouts_are_refused():
    with pytest.raises(InvalidParameterError, match="does not divide"):
        IntCodec(BS, H, D, 4, "per-token", 24)
    with pytest.raises(InvalidParameterError, match="head_dim 15 is not a multiple"):
        IntCodec(BS, H, 15, 4, "per-channel", 15)
    with pytest.raises(InvalidParameterError, match="int3 KV packs 8 channels"):
        IntCodec(BS, H, 20, 3, "per-channel", 20)


def test_fp8_without_torch_support_is_a_clear_error(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(InvalidParameterError, match="float8_e4m3fn"):
        Fp8Codec(BS, H, D)


def test_centred_levels_sit_at_the_bin_centres():
    """Centred int2 over a group spanning [0, 8): scale 2 and zero 1, so the codes of 0.2, 2.9,
    5.5 and 8 decode to 1, 3, 5 and 7, the centres of the four 2-wide bins."""
    codec = IntCodec(1, 1, 4, 2, "per-token", 4, centred=True)
    x = torch.tensor([0.0, 2.9, 5.5, 8.0]).view(1, 1, 1, 4)
    parts = codec.encode(x)
    assert parts["scale"].item() == 2.0 and parts["zero"].item() == 1.0
    assert codec.decode(parts, torch.float32).flatten().tolist() == [1.0, 3.0, 5.0, 7.0]


def test_int2_values_are_centred_and_keys_are_not():
    from kvledger.engine.kv.codecs import make_codecs

    keys, values = make_codecs("int2", BS, H, D, 16, "per-channel")
    assert values.centred and not keys.centred
    assert not make_codecs("int3", BS, H, D, 16, "per-channel")[1].centred
