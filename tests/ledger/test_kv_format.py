"""KVFormatSpec: the one value naming a KV format and its options."""

from __future__ import annotations

import dataclasses

import pytest

from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv_format import KVFormatSpec


def test_to_json_is_pinned():
    """Sorted keys, no spaces: the text must not drift (it may key caches and file headers)."""
    spec = KVFormatSpec("int4", group_size=32, key_quant="per-token", outlier_channels=4,
                        residual_tokens=64)
    assert spec.to_json() == (
        '{"group_size":32,"intact_tokens":null,"key_group_tokens":null,"key_quant":"per-token",'
        '"name":"int4","outlier_channels":4,"outlier_frac":0.0,"residual_tokens":64,'
        '"rotation":"none"}')
    assert KVFormatSpec().to_json() == (
        '{"group_size":null,"intact_tokens":0,"key_group_tokens":null,"key_quant":"per-channel",'
        '"name":"bf16","outlier_channels":null,"outlier_frac":0.0,"residual_tokens":null,'
        '"rotation":"none"}')


def test_rotation_is_in_the_json():
    """A disk-tier fingerprint hashes ``to_json``: blocks of a rotated format differ."""
    rotated = KVFormatSpec("int4", rotation="hadamard")
    assert '"rotation":"hadamard"' in rotated.to_json()
    assert rotated.to_json() != KVFormatSpec("int4").to_json()
    assert rotated.as_format("bf16").rotation == "none"


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        KVFormatSpec().name = "int4"  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "int5"}, "unknown KV format 'int5'; choose one of fp32, fp16, bf16, fp8, int8, int4, int3, int2"),
    ({"key_quant": "per-row"}, "--kv-key-quant must be one of per-channel, per-token"),
    ({"name": "int4", "rotation": "givens"}, "--kv-rotation must be one of none, hadamard"),
    ({"rotation": "hadamard"}, "--kv-rotation hadamard applies to quantized KV formats, not bf16"),
])
def test_bad_options_are_refused_with_their_name(kwargs, message):
    with pytest.raises(InvalidParameterError, match=message):
        KVFormatSpec(**kwargs)


def test_from_options_resolves_auto_to_the_compute_format():
    assert KVFormatSpec.from_options("auto", "fp32").name == "fp32"
    assert KVFormatSpec.from_options("auto").name == "bf16"
    spec = KVFormatSpec.from_options("int8", "fp32", 64, "per-token", 2)
    assert spec == KVFormatSpec("int8", 64, "per-token", 2)


def test_as_format_drops_outliers_on_full_precision():
    spec = KVFormatSpec("int4", group_size=64, outlier_channels=4, outlier_frac=0.1)
    assert spec.as_format("int8") == dataclasses.replace(spec, name="int8")
    assert spec.as_format("bf16") == KVFormatSpec("bf16", group_size=64)


def test_outlier_count_channels_or_fraction():
    assert KVFormatSpec("int4", outlier_channels=4).outlier_count(128) == 4
    assert KVFormatSpec("int4", outlier_frac=0.02).outlier_count(128) == 3  # ceil(2.56)
    assert KVFormatSpec("int4").outlier_count(128) == 0
    with pytest.raises(InvalidParameterError, match=r"in \[0, head_dim 128\), got 128"):
        KVFormatSpec("int4", outlier_channels=128).outlier_count(128)


def _sealed_oracle(tokens: int, bs: int, group: int, window: int) -> int:
    """Blocks sealed, simulated token by token: append a token; while the unsealed tokens
    fill the window of ``window`` tokens, seal the oldest whole key group."""
    sealed = 0
    for n in range(1, tokens + 1):
        while n - sealed >= window:  # the window is full: the oldest group leaves it
            sealed += group
    return sealed // bs


@pytest.mark.parametrize("name, bs, group, window", [
    ("int4", 16, None, None), ("int4", 16, None, 128), ("int2", 16, None, None),
    ("int2", 16, 32, 128), ("int3", 32, 64, 64), ("int2", 16, 64, 128)])
def test_sealed_blocks_keep_the_window(name, bs, group, window):
    """The closed form equals the token-by-token rule; the window then holds between R - G
    and R - 1 tokens, and full_precision_blocks counts the rest."""
    fmt = KVFormatSpec(name, key_group_tokens=group, residual_tokens=window, intact_tokens=0)
    g = fmt.key_group_blocks(bs) * bs
    r = fmt.residual_blocks(bs) * bs
    for tokens in range(400):
        sealed = fmt.sealed_blocks(tokens, bs)
        assert sealed == _sealed_oracle(tokens, bs, g, r), tokens
        assert sealed % (g // bs) == 0
        if tokens >= r:
            assert r - g <= tokens - sealed * bs <= r - 1
        assert fmt.full_precision_blocks(tokens, bs) == -(-tokens // bs) - sealed
        assert fmt.full_precision_blocks(tokens, bs) <= r // bs


def test_default_key_group_and_window():
    """The best settings measured at the serving chunk (issue 58) are the defaults: int3 /
    int2 keys over 32 tokens, rounded up to whole blocks, the others one block; a window of
    128 tokens for int4 / int3 / int2 (rounded up to whole blocks and to the key group), the
    key group for int8 / fp8; 32 intact tokens for int4 / int3 / int2, none for the others."""
    assert KVFormatSpec("int2").key_group_blocks(16) == 2
    assert KVFormatSpec("int3").key_group_blocks(48) == 1
    assert KVFormatSpec("int3").key_group_blocks(16) == 2
    assert KVFormatSpec("int4").key_group_blocks(16) == 1
    assert KVFormatSpec("int2", key_quant="per-token").key_group_blocks(16) == 1
    assert KVFormatSpec("fp8", key_group_tokens=64).key_group_blocks(16) == 1
    assert KVFormatSpec("int2").residual_blocks(16) == 8
    assert KVFormatSpec("int4").residual_blocks(16) == 8
    assert KVFormatSpec("int4").residual_blocks(48) == 3  # 128 rounded up to 144
    assert KVFormatSpec("int2", key_group_tokens=256).residual_blocks(16) == 16
    assert KVFormatSpec("int8").residual_blocks(16) == 1
    assert KVFormatSpec("fp8").residual_blocks(16) == 1
    assert KVFormatSpec("int8").sealed_blocks(40, 16) == 2  # full blocks, as before
    assert KVFormatSpec("int4").sealed_blocks(40, 16) == 0  # inside the window of 128
    assert KVFormatSpec("int4").sealed_blocks(200, 16) == 5  # 200 - 128 + 16 = 88 -> 5 blocks
    assert KVFormatSpec("bf16").sealed_blocks(40, 16) == 0
    assert KVFormatSpec("int4").intact_blocks(16) == 2
    assert KVFormatSpec("int2").intact_blocks(16) == 2  # one key group of 32
    assert KVFormatSpec("int2", key_group_tokens=64).intact_blocks(16) == 4  # rounded up
    assert KVFormatSpec("int4", intact_tokens=0).intact_blocks(16) == 0
    assert KVFormatSpec("int8").intact_blocks(16) == 0
    assert KVFormatSpec("bf16").intact_blocks(16) == 0


def test_blockwise_defaults_keep_explicit_options():
    """For KV tiers and sliding layers: the defaults become keys over one block and no
    intact tokens; explicit options stay (for the engine to refuse)."""
    assert KVFormatSpec("int3").blockwise_defaults(16) == KVFormatSpec(
        "int3", key_group_tokens=16, intact_tokens=0)
    assert KVFormatSpec("int3").blockwise_defaults(16).residual_blocks(16) == 8
    assert KVFormatSpec("int3", key_group_tokens=32, intact_tokens=32).blockwise_defaults(16) \
        == KVFormatSpec("int3", key_group_tokens=32, intact_tokens=32)


@pytest.mark.parametrize("kwargs, message", [
    ({"key_group_tokens": 40}, "--kv-key-group-tokens 40 must be a positive multiple of --block"),
    ({"key_group_tokens": 0}, "--kv-key-group-tokens 0 must be a positive multiple"),
    ({"residual_tokens": 24}, "--kv-residual-tokens 24 must be a positive multiple of --block"),
    ({"key_group_tokens": 64, "residual_tokens": 32},
     "--kv-residual-tokens 32 must be at least the key group of 64"),
])
def test_key_group_and_window_refused(kwargs, message):
    with pytest.raises(InvalidParameterError, match=message):
        KVFormatSpec("int2", **kwargs).residual_blocks(16)
