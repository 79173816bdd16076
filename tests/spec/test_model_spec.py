"""ModelSpec's groups: built from the flat names and given back by them, an optional group None
when the model has none of it, the derived properties read through the groups."""

from __future__ import annotations

import dataclasses

import pytest

from kvledger.data import configs_dir
from kvledger.errors import ConfigError
from kvledger.model.families import spec_from_hf_config
from kvledger.spec import FULL, SLIDING, Experts, ModelSpec
from kvledger.spec.groups import FLAT_NAMES, GROUPS, OPTIONAL

CORE = {"name": "tiny", "model_type": "llama", "num_layers": 2, "hidden_size": 32,
        "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 8, "intermediate_size": 64,
        "vocab_size": 128, "max_position_embeddings": 128}


def test_every_group_field_has_one_flat_name():
    paths = [(group, f.name) for group, kind in GROUPS.items()
             for f in dataclasses.fields(kind)]
    assert sorted(FLAT_NAMES.values()) == sorted(paths)
    core = {f.name for f in dataclasses.fields(ModelSpec)} - set(GROUPS)
    assert not core & set(FLAT_NAMES)


@pytest.mark.parametrize("path", sorted(configs_dir().glob("*.json")), ids=lambda p: p.stem)
def test_flat_fields_round_trip(path):
    spec = spec_from_hf_config(path)
    assert ModelSpec.from_fields(**spec.as_fields()) == spec
    assert spec.with_fields() == spec


def test_a_dense_model_has_no_optional_group():
    spec = ModelSpec.from_fields(**CORE)
    assert all(getattr(spec, group) is None for group in OPTIONAL)
    assert spec.layers.types == (FULL, FULL) and spec.layers.windows == (None, None)
    assert not spec.is_moe and not spec.is_moe_layer(0)
    assert spec.as_fields()["num_experts"] == 0 and spec.as_fields()["kv_lora_rank"] == 0


def test_flat_names_land_in_their_groups():
    spec = ModelSpec.from_fields(**CORE, num_experts=4, num_experts_per_tok=2,
                                 mlp_only_layers=(0,), rope_theta=1e6,
                                 layer_types=(SLIDING, FULL), sliding_window=16,
                                 query_pre_attn_scalar=16.0, partial_rotary_factor=0.5)
    assert spec.experts == Experts(count=4, per_token=2, mlp_only_layers=(0,))
    assert spec.rope.theta == 1e6 and spec.layers.windows == (16, None)
    assert [spec.is_moe_layer(i) for i in range(2)] == [False, True]
    assert spec.attention_scale == 16.0 ** -0.5 and spec.rotary_dim == 4
    assert spec.with_fields(num_experts=0, num_experts_per_tok=0, mlp_only_layers=()).experts \
        is None


def test_unknown_names_and_bad_values_are_refused():
    with pytest.raises(TypeError):
        ModelSpec.from_fields(**CORE, num_expert=4)
    with pytest.raises(ConfigError, match="sliding_window"):
        ModelSpec.from_fields(**CORE, layer_types=(SLIDING, FULL))
    with pytest.raises(ConfigError, match="layer types"):
        ModelSpec.from_fields(**CORE, layer_types=(FULL,))
