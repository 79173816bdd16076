"""Every numeric field of a ModelSpec is checked by range when the spec is built, naming the
field (``spec/ranges.py``): for each field of the table, values just outside its range, NaN,
the infinities, a bool, a string and a huge integer are ConfigErrors that name it; and the
issue's cases through a real config.json. Old code (485cae7): every field below but the seven
core counts and ``intermediate_size`` was accepted silently (``rope_theta`` -1, NaN, ...)."""

from __future__ import annotations

import json
import math
import re

import pytest

from kvledger.data import configs_dir
from kvledger.errors import ConfigError
from kvledger.model.families import spec_from_hf_config
from kvledger.spec.ranges import ROPE_SCALING_RANGES, SPEC_RANGES

BASE = "HuggingFaceTB__SmolLM2-135M"


@pytest.fixture(scope="module")
def base_spec():
    return spec_from_hf_config(configs_dir() / f"{BASE}.json")


def bad_values(allowed) -> list:
    """Values outside ``allowed``: next to each bound, wrong types, NaN, infinities, 2^64."""
    step = 1 if allowed.integer else 1e-9
    out = [math.nan, math.inf, -math.inf, True, "1", [1], -(10**400)]
    out.append(1 << 64 if allowed.integer else 10**400)
    if allowed.lo is not None:
        out.append(allowed.lo if allowed.lo_open else allowed.lo - step)
    if allowed.hi is not None:
        out.append(allowed.hi if allowed.hi_open else allowed.hi + step)
    if allowed.integer:
        out.append(1.5)
    if not allowed.optional:
        out.append(None)
    return out


@pytest.mark.parametrize("name", sorted(SPEC_RANGES))
def test_each_field_out_of_range_is_refused_by_name(base_spec, name):
    default = base_spec.as_fields()[name]
    for value in bad_values(SPEC_RANGES[name]):
        if value is True and default == 1:
            continue  # True == 1: an absent group of defaults, which the spec cannot tell
        with pytest.raises(ConfigError, match=rf"^{re.escape(name)} must be "):
            base_spec.with_fields(**{name: value})


@pytest.mark.parametrize("key", sorted(ROPE_SCALING_RANGES))
def test_each_rope_scaling_number_is_refused_by_name(base_spec, key):
    scaling = {"rope_type": "linear", "factor": 2.0}
    for value in (-1.0, math.nan, math.inf, "2", None, *(() if key.startswith("mscale") else (0,))):
        with pytest.raises(ConfigError, match=rf"^rope_scaling\.{key} must be "):
            base_spec.with_fields(rope_scaling={**scaling, key: value})


def test_in_range_values_still_build(base_spec):
    """The bounds themselves, where closed, are accepted (the table is not tighter than it
    says)."""
    spec = base_spec.with_fields(partial_rotary_factor=1.0, rms_norm_eps=1e-6,
                                 rope_theta=1e-3, bos_token_id=0, norms_per_layer=4)
    assert spec.rope.partial_rotary_factor == 1.0 and spec.norm.per_layer == 4


@pytest.mark.parametrize("path", sorted(configs_dir().glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_config_passes_the_table(path):
    """Real configs (RoPE scaling of every type, MLA, linear attention, learned positions,
    partial RoPE, experts) are in range."""
    assert spec_from_hf_config(path).num_layers >= 1


@pytest.mark.parametrize(("key", "value", "why"), [
    ("rope_theta", -1, r"rope_theta must be a number in \(0, inf\), got -1"),
    ("rope_theta", math.nan, r"rope_theta must be a number in \(0, inf\), got nan"),
    ("rms_norm_eps", -1, r"rms_norm_eps must be a number in \(0, 1\), got -1"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0},
     r"rope_scaling.factor must be a number in \(0, inf\), got 0"),
    ("head_dim", 63, r"63 rotary dimensions: RoPE needs an even count"),
    ("rope_theta", "yes", r"'rope_theta' must be a number, got 'yes'"),
])
def test_the_issues_configs_are_refused_by_name(tmp_path, key, value, why):
    raw = json.loads((configs_dir() / f"{BASE}.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, key: value}))
    with pytest.raises(ConfigError, match=why):
        spec_from_hf_config(path)


@pytest.mark.parametrize("window, why", [(0, "sliding_window must be an integer in"),
                                         (-1, "sliding_window must be an integer in")])
def test_a_sliding_window_out_of_range_names_it(tmp_path, window, why):
    """Old code: 0 passed the reader; -1 was refused later as 'KV budget too small'."""
    raw = json.loads((configs_dir() / "mistralai__Mistral-7B-v0.1.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**raw, "sliding_window": window}))
    with pytest.raises(ConfigError, match=why):
        spec_from_hf_config(path)
