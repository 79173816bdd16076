"""ModelSpec fields of a GGUF ``deepseek2`` file (DeepSeek-V2 / V2-Lite), as llama.cpp's
``convert_hf_to_gguf`` (``conversion/deepseek.py``, ``DeepseekV2Model``) writes them.

The converter stores MLA as MQA over the latent: ``attention.head_count_kv`` 1,
``attention.key_length`` ``kv_lora_rank + qk_rope_head_dim`` and ``attention.value_length``
``kv_lora_rank``; the per-head sizes are ``attention.key_length_mla`` (``qk_nope_head_dim +
qk_rope_head_dim``) and ``attention.value_length_mla`` (``v_head_dim``), the RoPE width
``rope.dimension_count``. ``leading_dense_block_count`` layers are dense, then
``expert_count`` experts of ``expert_feed_forward_length`` with ``expert_used_count`` per token,
``expert_shared_count`` shared ones, weights times ``expert_weights_scale`` (absent: 1) and
renormalised only when ``expert_weights_norm`` is true. YaRN's ``mscale_all_dim`` is
``rope.scaling.yarn_log_multiplier / 0.1``; ``mscale`` is not written, and is taken equal to it
(llama.cpp's deepseek2 graph assumes so). Group-limited routing is not written either: the
top-k is greedy. Torch-free.
"""

from __future__ import annotations

from kvledger.spec.groups import MLA


def deepseek2_fields(value, num_layers: int, heads: int, scaling: dict | None) -> dict:
    """The fields a ``deepseek2`` file sets beyond the generic reader's.

    Args:
        value: ``key -> metadata value or None`` for keys without the ``deepseek2.`` prefix.
        num_layers, heads: the file's block and head counts; scaling: its ``rope_scaling``.
    """
    rope = int(value("rope.dimension_count"))
    key_mla = int(value("attention.key_length_mla"))
    dense = int(value("leading_dense_block_count") or 0)
    experts = int(value("expert_count") or 0)
    if scaling and scaling.get("rope_type") == "yarn" and value(
            "rope.scaling.yarn_log_multiplier"):
        mscale = float(value("rope.scaling.yarn_log_multiplier")) / 0.1
        scaling = {**scaling, "mscale": mscale, "mscale_all_dim": mscale}
    return {
        "layer_types": (MLA,) * num_layers,
        "num_kv_heads": heads,
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
