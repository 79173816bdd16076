"""Every ModelSpec field is implemented, refused away from its neutral value, or not part of
the forward; a new field in none of the lists fails here until someone decides."""

from __future__ import annotations

import dataclasses

import pytest

from kvledger.errors import UnsupportedModelError
from kvledger.model.families import FAMILIES, check_runnable
from kvledger.spec import ModelSpec
from kvledger.spec.groups import FLAT_NAMES, GROUPS
from kvledger.spec.runnable import IMPLEMENTED, NOT_FORWARD, ONLY_AT

FAMILY_RUNS = {f.name: f.runs for f in FAMILIES.families if f.runs_in_engine}
FAMILY_TYPES = {f.name: f.model_types for f in FAMILIES.families if f.runs_in_engine}

LLAMA = ModelSpec.from_fields(name="tiny", model_type="llama", num_layers=2, hidden_size=32,
                  num_attention_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                  vocab_size=128, max_position_embeddings=128)
# one spec each engine family runs
BASE = {"llama": LLAMA, "qwen3": LLAMA.with_fields(model_type="qwen3", qk_norm=True),
        "phi3": LLAMA.with_fields(model_type="phi3", partial_rotary_factor=0.5),
        "gemma": LLAMA.with_fields(model_type="gemma2", hidden_act="gelu_pytorch_tanh",
                                     norms_per_layer=4, attn_logit_softcapping=50.0),
        "moe": LLAMA.with_fields(model_type="qwen3_moe", qk_norm=True, num_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=16,
                                   mlp_only_layers=(1,), norm_topk_prob=True),
        "gpt_oss": LLAMA.with_fields(model_type="gpt_oss", num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, norm_topk_prob=True, router_bias=True, mlp_bias=True,
            qkv_bias=True, o_bias=True, attention_sinks=True, swiglu_limit=7.0,
            swiglu_alpha=1.702, layer_types=("sliding_attention", "full_attention"),
            sliding_window=8, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        "deepseek": LLAMA.with_fields(model_type="deepseek_v2", layer_types=("mla",) * 2,
                                        head_dim=12, kv_lora_rank=16, q_lora_rank=8,
                                        qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                                        num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=16, num_shared_experts=1,
                                        shared_expert_intermediate_size=16, mlp_only_layers=(0,),
                                        routed_scaling_factor=1.5, n_group=2, topk_group=1,
                                        topk_method="group_limited_greedy",
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        "olmo3": LLAMA.with_fields(model_type="olmo3", qk_norm=True,
                                     qk_norm_full_width=True, sliding_window=8,
                                     layer_types=("sliding_attention", "full_attention"),
                                     rope_local_base_freq=10000.0,
                                     rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        "lfm2": LLAMA.with_fields(model_type="lfm2", qk_norm=True,
                                    layer_types=("conv", "full_attention"), state_conv_dim=32,
                                    state_conv_kernel=3, state_conv_bias=True),
        "qwen3_5": LLAMA.with_fields(model_type="qwen3_5_text", qk_norm=True,
                                       attn_output_gate=True, partial_rotary_factor=0.25,
                                       layer_types=("linear_attention", "full_attention"),
                                       linear_num_key_heads=2, linear_num_value_heads=4,
                                       linear_key_head_dim=8, linear_value_head_dim=8,
                                       linear_conv_kernel_dim=4, state_conv_dim=64,
                                       state_conv_kernel=4, state_recurrent_shape=(4, 8, 8)),
        "granitehybrid": LLAMA.with_fields(
            model_type="granitemoehybrid", layer_types=("mamba", "full_attention"),
            position_embedding_type="nope", attention_multiplier=0.1,
            embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=6.0,
            mamba_num_heads=2, mamba_head_dim=8, mamba_state_size=4, mamba_n_groups=1,
            mamba_chunk_size=64, mamba_proj_bias=True, state_conv_dim=24, state_conv_kernel=4,
            state_recurrent_shape=(2, 8, 4), state_conv_bias=True, o_bias=True, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
            shared_expert_intermediate_size=16, norm_topk_prob=True)}
# a value the engine does not run, for each field of ONLY_AT (the rest: not the default, or 7)
OFF = {"model_type": "olmo2", "layer_types": ("mla", "full_attention"), "sliding_window": 64,
       "hidden_act": "gelu", "weights_dtype": "fp8", "mlp_gated": False, "norms_per_layer": 3,
       "position_embeddings": 128, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0},
       "rope_local_base_freq": 10000.0, "partial_rotary_factor": 0.5, "topk_method": "noaux_tc",
       "mlp_only_layers": (1,)}


FAMILY_OFF = {"gpt_oss": {"rope_scaling": {"rope_type": "longrope"}}}
"""A value the family does not run where :data:`OFF`'s is one it runs."""


def _off(spec, name):
    if name in FAMILY_OFF.get(spec.model_type, {}):
        return FAMILY_OFF[spec.model_type][name]
    default = spec.as_fields()[name]
    return OFF.get(name, (not default) if isinstance(default, bool) else 7)


def _flat_names() -> list[str]:
    """Every ModelSpec field, walking into its groups (a group's field by its flat name)."""
    flat = {path: name for name, path in FLAT_NAMES.items()}
    names = []
    for f in dataclasses.fields(ModelSpec):
        if f.name in GROUPS:
            names += [flat[(f.name, g.name)] for g in dataclasses.fields(GROUPS[f.name])]
        else:
            names.append(f.name)
    return names


def test_every_field_is_in_exactly_one_list():
    names = _flat_names()
    lists = (IMPLEMENTED, set(ONLY_AT), NOT_FORWARD)
    unlisted = [n for n in names if not any(n in lst for lst in lists)]
    twice = [n for n in names if sum(n in lst for lst in lists) > 1]
    assert not unlisted, f"decide whether the engine implements or refuses: {unlisted}"
    assert not twice and set().union(*lists) == set(names)
    assert set(FAMILY_RUNS) == set(FAMILY_TYPES) == set(BASE)
    assert all(set(runs) <= set(ONLY_AT) for runs in FAMILY_RUNS.values())


def test_the_defaults_run():
    assert check_runnable(LLAMA) == "llama"
    check_runnable(LLAMA.with_fields(model_type="qwen2", qkv_bias=True))
    for family, spec in BASE.items():
        assert check_runnable(spec) == family


@pytest.mark.parametrize(("family", "name"), [
    (family, name) for family in sorted(FAMILY_RUNS) for name in sorted(ONLY_AT)
    if name not in FAMILY_RUNS[family] or name in ("layer_types", "hidden_act",
                                                    "norms_per_layer", "rope_scaling")])
def test_each_other_value_is_refused_by_name(family, name):
    spec = BASE[family]
    with pytest.raises(UnsupportedModelError, match=name):
        check_runnable(spec.with_fields(**{name: _off(spec, name)}))


def test_a_family_runs_the_values_it_lists():
    for spec in (LLAMA.with_fields(model_type="mistral", sliding_window=16,
                                     layer_types=("sliding_attention",) * 2),
                 BASE["phi3"].with_fields(rope_scaling={"rope_type": "longrope"}),
                 BASE["gemma"].with_fields(rope_local_base_freq=10000.0, qk_norm=True,
                                     query_pre_attn_scalar=7.0, final_logit_softcapping=30.0)):
        check_runnable(spec)
