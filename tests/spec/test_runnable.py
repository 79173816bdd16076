"""Every ModelSpec field is implemented, refused away from its neutral value, or not part of
the forward; a new field in none of the lists fails here until someone decides."""

from __future__ import annotations

import dataclasses

import pytest

from kvledger.errors import UnsupportedModelError
from kvledger.spec import ModelSpec, check_runnable
from kvledger.spec.runnable import IMPLEMENTED, NOT_FORWARD, ONLY_AT

LLAMA = ModelSpec(name="tiny", model_type="llama", num_layers=2, hidden_size=32,
                  num_attention_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                  vocab_size=128, max_position_embeddings=128)
# a value the engine does not run, for each field of ONLY_AT
OFF = {"model_type": "qwen3", "layer_types": ("sliding_attention", "full_attention"),
       "sliding_window": 64, "hidden_act": "gelu", "weights_dtype": "fp8", "mlp_gated": False,
       "norms_per_layer": 4, "position_embeddings": 128}


def test_every_field_is_in_exactly_one_list():
    names = [f.name for f in dataclasses.fields(ModelSpec)]
    lists = (IMPLEMENTED, set(ONLY_AT), NOT_FORWARD)
    unlisted = [n for n in names if not any(n in lst for lst in lists)]
    twice = [n for n in names if sum(n in lst for lst in lists) > 1]
    assert not unlisted, f"decide whether the engine implements or refuses: {unlisted}"
    assert not twice and set().union(*lists) == set(names)


def test_the_llama_defaults_run():
    check_runnable(LLAMA)
    check_runnable(dataclasses.replace(LLAMA, model_type="qwen2", qkv_bias=True))


@pytest.mark.parametrize("name", sorted(ONLY_AT))
def test_each_other_value_is_refused_by_name(name):
    default = getattr(LLAMA, name)
    value = OFF.get(name, (not default) if isinstance(default, bool) else 7)
    with pytest.raises(UnsupportedModelError, match=name):
        check_runnable(dataclasses.replace(LLAMA, **{name: value}))
