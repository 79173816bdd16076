"""DeepSeek-V2 and V2-Lite (arXiv:2405.04434; transformers' ``DeepseekV2ForCausalLM``):
multi-head latent attention (``kvledger.model.layers.latent_attention``) on every layer, a dense
SwiGLU MLP on the first ``first_k_dense_replace`` layers and DeepSeekMoE after them (routed
experts, group-limited or greedy, scaled by ``routed_scaling_factor``, never renormalised, plus
shared experts: ``kvledger.model.layers.experts``). Dense layers past the first k
(``moe_layer_freq``) and ``norm_topk_prob`` are refused at start: transformers' model has
neither. :func:`mla_fields` also reads DeepSeek-V3 and Kimi K2 (``.deepseek_v3``).

GGUF ``deepseek2`` (llama.cpp's ``convert_hf_to_gguf``, ``DeepseekV2Model``): MLA is written as
MQA over the latent: ``attention.head_count_kv`` 1, ``attention.key_length`` ``kv_lora_rank +
qk_rope_head_dim`` and ``attention.value_length`` ``kv_lora_rank``; the per-head sizes are
``attention.key_length_mla`` (``qk_nope_head_dim + qk_rope_head_dim``) and
``attention.value_length_mla`` (``v_head_dim``), the RoPE width ``rope.dimension_count``.
``leading_dense_block_count`` layers are dense, then ``expert_count`` experts of
``expert_feed_forward_length`` with ``expert_used_count`` per token, ``expert_shared_count``
shared ones, weights times ``expert_weights_scale`` (absent: 1) and renormalised only when
``expert_weights_norm`` is true. YaRN's ``mscale_all_dim`` is
``rope.scaling.yarn_log_multiplier / 0.1``; ``mscale`` is not written, and is taken equal to it
(llama.cpp's deepseek2 graph assumes so). Group-limited routing is not written either: the
top-k is greedy. The converter splits ``kv_b_proj`` per head into ``attn_k_b`` [H, L, nope]
(transposed) and ``attn_v_b`` [H, v, L]; they are joined back when loaded.
"""

from __future__ import annotations

from kvledger.model.layers import plain_decoder
from kvledger.spec import (
    MLA,
    Config,
    Family,
    GGUFHeader,
    ModelSpec,
    any_value,
    is_,
    leading,
    rope_types,
)


def mla_fields(c: Config, n: int) -> dict:
    """DeepSeek-V2/V3, Kimi K2: MLA on every layer; ``first_k_dense_replace`` dense layers, then
    routed + shared experts every ``moe_layer_freq`` layers (arXiv:2405.04434, 2412.19437).
    A missing or null ``q_lora_rank`` means no query compression (DeepSeek-V2-Lite's upstream
    config has ``null``)."""
    first_k = int(c.get("first_k_dense_replace", 0))
    freq = int(c.get("moe_layer_freq", 1))
    dense = tuple(i for i in range(n) if i < first_k or i % freq)
    nope, rope = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim")
    return {
        "layer_types": (MLA,) * n,
        "head_dim": nope + rope,
        "kv_lora_rank": c.int("kv_lora_rank"),
        "q_lora_rank": int(c.get("q_lora_rank") or 0),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": nope,
        "v_head_dim": c.int("v_head_dim"),
        "num_experts": c.int("n_routed_experts"),
        "num_experts_per_tok": c.int("num_experts_per_tok"),
        "moe_intermediate_size": c.int("moe_intermediate_size"),
        "num_shared_experts": int(c.get("n_shared_experts", 0)),
        "shared_expert_intermediate_size": c.int("moe_intermediate_size"),
        "mlp_only_layers": dense,
        "norm_topk_prob": bool(c.get("norm_topk_prob", False)),
        "router_bias": c.get("topk_method") == "noaux_tc",
        "routed_scaling_factor": float(c.get("routed_scaling_factor") or 1.0),
        "topk_method": c.get("topk_method") or "greedy",
        "n_group": int(c.get("n_group") or 0),
        "topk_group": int(c.get("topk_group") or 0),
    }


def _gguf_fields(header: GGUFHeader, fields: dict) -> dict:
    """The fields a ``deepseek2`` file sets beyond the generic reader's (module docstring)."""
    value, num_layers = header.value, fields["num_layers"]
    rope = int(value("rope.dimension_count"))
    key_mla = int(value("attention.key_length_mla"))
    dense = int(value("leading_dense_block_count") or 0)
    experts = int(value("expert_count") or 0)
    scaling = fields["rope_scaling"]
    if scaling and scaling.get("rope_type") == "yarn" and value(
            "rope.scaling.yarn_log_multiplier"):
        mscale = float(value("rope.scaling.yarn_log_multiplier")) / 0.1
        scaling = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
    return {
        "layer_types": (MLA,) * num_layers,
        "num_kv_heads": fields["num_attention_heads"],
        "head_dim": key_mla,
        "kv_lora_rank": int(value("attention.kv_lora_rank")),
        "q_lora_rank": int(value("attention.q_lora_rank") or 0),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key_mla - rope,
        "v_head_dim": int(value("attention.value_length_mla")),
        "partial_rotary_factor": 1.0,
        "rope_scaling": scaling,
        "num_experts": experts,
        "num_experts_per_tok": int(value("expert_used_count") or 0),
        "moe_intermediate_size": int(value("expert_feed_forward_length") or 0),
        "num_shared_experts": int(value("expert_shared_count") or 0),
        "shared_expert_intermediate_size": int(value("expert_feed_forward_length") or 0),
        "mlp_only_layers": tuple(range(min(dense, num_layers))) if experts else (),
        "routed_scaling_factor": float(value("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(value("expert_weights_norm") or False),
    }


def _weight_names(state: dict, spec: ModelSpec) -> None:
    """A GGUF's ``k_b_proj`` [heads, L, nope] and ``v_b_proj`` [heads, v, L] ->
    ``kv_b_proj`` [heads * (nope + v), L]."""
    import torch

    for i in range(spec.num_layers):
        p = f"model.layers.{i}.self_attn."
        k_b = state.pop(p + "k_b_proj.weight", None)
        if k_b is not None:
            v_b = state.pop(p + "v_b_proj.weight")
            state[p + "kv_b_proj.weight"] = torch.cat(
                (k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1]).contiguous()


FAMILY = Family(
    name="deepseek",
    model_types=("deepseek_v2",),
    runs={"layer_types": lambda kinds: set(kinds) == {MLA},
          "rope_scaling": rope_types("default", "yarn"),
          "num_experts": any_value, "num_experts_per_tok": any_value,
          "moe_intermediate_size": any_value, "num_shared_experts": any_value,
          "shared_expert_intermediate_size": any_value, "mlp_only_layers": leading,
          "routed_scaling_factor": any_value,
          "topk_method": is_("greedy", "group_limited_greedy"), "n_group": any_value,
          "topk_group": any_value, "kv_lora_rank": any_value, "q_lora_rank": any_value,
          "qk_rope_head_dim": any_value, "qk_nope_head_dim": any_value,
          "v_head_dim": any_value},
    config_fields=mla_fields,
    gguf_archs={"deepseek2": "deepseek_v2"},
    gguf_fields=_gguf_fields,
    gguf_tensors={"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                  "attn_q_b": "self_attn.q_b_proj",
                  "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm",
                  "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj",
                  "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                  "ffn_up_shexp": "mlp.shared_experts.up_proj",
                  "ffn_down_shexp": "mlp.shared_experts.down_proj"},
    weight_names=_weight_names,
    model=plain_decoder,
)
