"""Which models the engine runs exactly: no silently wrong model. The one place that decides.

Every :class:`ModelSpec` field, a group's by its flat name (``num_experts`` for
``experts.count``, :meth:`ModelSpec.as_fields`), falls in one of three lists
(``tests/spec/test_runnable.py`` walks the groups and fails when a new field is in none):

- :data:`IMPLEMENTED`: every family's forward pass honours every value (logits checked against
  transformers: ``tests/model/test_llama.py``, ``tests/model/test_family_oracle.py``);
- :data:`ONLY_AT`: the field changes the forward, and the engine runs only the values listed:
  the plain Llama decoder's, widened per family by :data:`FAMILY_RUNS` (each checked by its
  family's oracle); any other value is refused at load, by name, before weights are read;
- :data:`NOT_FORWARD`: names, token ids and file facts that do not change what is computed.

Torch-free: the model classes (``kvledger.model.families``) are looked up by the family names
of :data:`FAMILY_TYPES`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.errors import UnsupportedModelError
from kvledger.spec.groups import FULL, MLA, SLIDING
from kvledger.spec.model_spec import ModelSpec

FAMILY_TYPES: dict[str, tuple[str, ...]] = {
    "llama": ("llama", "mistral", "qwen2"), "qwen3": ("qwen3",), "phi3": ("phi3",),
    "gemma": ("gemma2", "gemma3_text"), "moe": ("mixtral", "qwen3_moe"),
    "gpt_oss": ("gpt_oss",),
    "deepseek": ("deepseek_v2",)}
"""Engine family (one module of ``kvledger.model``) -> the ``model_type`` values it runs."""
ENGINE_MODEL_TYPES = tuple(t for types in FAMILY_TYPES.values() for t in types)
"""The families whose decoder the engine runs (others are sized by `kvledger plan` only)."""
FAMILY_OF = {t: family for family, types in FAMILY_TYPES.items() for t in types}
PLAN_ONLY = {"gpt2": "a LayerNorm, learned-position decoder",
             "gpt_neox": "a LayerNorm decoder with parallel attention and MLP",
             "deepseek_v3": "multi-head latent attention and routed experts"}
"""Families `kvledger plan` sizes that the engine refuses, with what they are."""

IMPLEMENTED = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
    "rms_norm_eps", "rope_theta", "qkv_bias",
})


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


def _any(value: Any) -> bool:
    return True


def _set(value: Any) -> bool:
    return value is not None


def _rope(*types: str) -> Callable[[Any], bool]:
    return lambda scaling: (scaling or {}).get("rope_type", "default") in types


def _leading(layers: tuple[int, ...]) -> bool:
    return layers == tuple(range(len(layers)))  # DeepSeek's first_k_dense_replace dense layers


def _kinds(kinds: tuple[str, ...]) -> bool:
    return set(kinds) <= {FULL, SLIDING}  # full and sliding layers, each its own window


ONLY_AT: dict[str, Callable[[Any], bool]] = {
    "model_type": _is(*ENGINE_MODEL_TYPES),
    "rope_scaling": _rope("default", "linear", "llama3"),
    "rope_local_base_freq": _is(None),
    "partial_rotary_factor": _is(1.0),
    "layer_types": lambda kinds: set(kinds) == {FULL},
    "sliding_window": _is(None),
    "hidden_act": _is("silu", "swish"),  # transformers' ACT2FN: both are SiLU
    "query_pre_attn_scalar": _is(None),
    "attn_logit_softcapping": _is(None),
    "final_logit_softcapping": _is(None),
    "weights_dtype": _is("fp32", "fp16", "bf16"),  # fp8 needs its scales applied
    "mlp_gated": _is(True),
    "o_bias": _is(False),
    "mlp_bias": _is(False),
    "norm_bias": _is(False),
    "norms_per_layer": _is(2),
    "qk_norm": _is(False),
    "attn_output_gate": _is(False),
    "attention_sinks": _is(False),
    "position_embeddings": _is(0),
    "num_experts": _is(0),
    "num_experts_per_tok": _is(0),
    "moe_intermediate_size": _is(0),
    "num_shared_experts": _is(0),
    "shared_expert_intermediate_size": _is(0),
    "mlp_only_layers": _is(()),
    "router_bias": _is(False),
    "swiglu_limit": _is(None),
    "swiglu_alpha": _is(None),
    "shared_expert_gate": _is(False),
    "norm_topk_prob": _is(False),
    "routed_scaling_factor": _is(1.0),
    "topk_method": _is("greedy"),
    "n_group": _is(0),
    "topk_group": _is(0),
    "kv_lora_rank": _is(0),
    "q_lora_rank": _is(0),
    "qk_rope_head_dim": _is(0),
    "qk_nope_head_dim": _is(0),
    "v_head_dim": _is(0),
    "linear_state_elements": _is(0),
    "linear_num_key_heads": _is(0),
    "linear_num_value_heads": _is(0),
    "linear_key_head_dim": _is(0),
    "linear_value_head_dim": _is(0),
    "linear_conv_kernel_dim": _is(0),
}
"""Field -> the values the plain Llama decoder runs (SwiGLU, RMSNorm, full attention)."""

FAMILY_RUNS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "llama": {"layer_types": _kinds, "sliding_window": _any},  # Mistral's window
    "qwen3": {"layer_types": _kinds, "sliding_window": _any, "qk_norm": _any},
    "phi3": {"layer_types": _kinds, "sliding_window": _any, "partial_rotary_factor": _any,
             "rope_scaling": _rope("default", "linear", "llama3", "longrope")},
    "gemma": {"layer_types": _kinds, "sliding_window": _any, "qk_norm": _any,
              "norms_per_layer": _is(4), "hidden_act": _is("gelu_pytorch_tanh"),
              "rope_local_base_freq": _any, "query_pre_attn_scalar": _any,
              "attn_logit_softcapping": _any, "final_logit_softcapping": _any},
    "moe": {"layer_types": _kinds, "sliding_window": _any, "qk_norm": _any,
            "num_experts": _any, "num_experts_per_tok": _any, "moe_intermediate_size": _any,
            "mlp_only_layers": _any, "norm_topk_prob": _any},  # routed experts, no shared one
    "gpt_oss": {"layer_types": _kinds, "sliding_window": _any, "o_bias": _any,
                "num_experts": _any, "num_experts_per_tok": _any, "moe_intermediate_size": _any,
                "rope_scaling": _rope("default", "yarn"), "router_bias": _is(True),
                "mlp_bias": _is(True), "attention_sinks": _is(True),
                "swiglu_limit": _set, "swiglu_alpha": _set,
                "norm_topk_prob": _any},  # biased experts, sinks
    # DeepSeek-V2: MLA, the first k layers dense, then routed + shared experts; transformers'
    # DeepseekV2Moe never renormalises (norm_topk_prob) and has no dense layer past the first k
    "deepseek": {"layer_types": lambda kinds: set(kinds) == {MLA},
                 "rope_scaling": _rope("default", "yarn"),
                 "num_experts": _any, "num_experts_per_tok": _any, "moe_intermediate_size": _any,
                 "num_shared_experts": _any, "shared_expert_intermediate_size": _any,
                 "mlp_only_layers": _leading, "routed_scaling_factor": _any,
                 "topk_method": _is("greedy", "group_limited_greedy"), "n_group": _any,
                 "topk_group": _any, "kv_lora_rank": _any, "q_lora_rank": _any,
                 "qk_rope_head_dim": _any, "qk_nope_head_dim": _any, "v_head_dim": _any},
}
"""Family -> the fields whose values it runs differ from :data:`ONLY_AT` (its own test)."""

NOT_FORWARD = frozenset({
    "name", "bos_token_id", "eos_token_ids", "gguf_tensor_elements", "gguf_tensor_bytes",
    "source", "extra",
})


def _shown(value: Any) -> str:
    return repr(sorted(set(value))) if isinstance(value, tuple) else repr(value)


def check_runnable(spec: ModelSpec) -> str:
    """Refuse a spec the engine would not compute exactly; return its family's name.

    Raises:
        UnsupportedModelError: naming the model type and the families the engine runs, or
            every field whose value the family does not run (``field=value``).
    """
    where = spec.source or spec.name
    family = FAMILY_OF.get(spec.model_type)
    if family is None:
        what = f" ({PLAN_ONLY[spec.model_type]})" if spec.model_type in PLAN_ONLY else ""
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r}{what} in {where} cannot run in the engine yet (it "
            f"runs {', '.join(ENGINE_MODEL_TYPES)}); `kvledger plan` still sizes it")
    allowed = {**ONLY_AT, **FAMILY_RUNS[family]}
    values = spec.as_fields()
    bad = [f"{name}={_shown(values[name])}" for name, ok in allowed.items()
           if not ok(values[name])]
    if bad:
        raise UnsupportedModelError(
            f"{where}: the engine cannot run {', '.join(bad)} yet (its {spec.model_type} "
            "forward pass would compute another model); `kvledger plan` still sizes it")
    return family
