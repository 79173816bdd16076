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
        '{"group_size":32,"key_quant":"per-token","name":"int4","outlier_channels":4,'
        '"outlier_frac":0.0,"residual_tokens":64,"rotation":"none"}')
    assert KVFormatSpec().to_json() == (
        '{"group_size":null,"key_quant":"per-channel","name":"bf16","outlier_channels":null,'
        '"outlier_frac":0.0,"residual_tokens":null,"rotation":"none"}')


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
