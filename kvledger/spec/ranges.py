"""The allowed range of every numeric field of a ModelSpec, by its flat (Hugging Face) name.

:func:`check_spec_fields` runs when a spec is built (``ModelSpec.__post_init__``), so a config
or GGUF header with a value no model has (``rope_theta`` -1 or NaN, ``rms_norm_eps`` -1,
``sliding_window`` 0, a linear RoPE ``factor`` of 0, a bool where a count belongs, a count
past 2^31) is a :class:`~kvledger.errors.ConfigError` naming the field, before anything is
allocated. Besides the table: the RoPE scaling numbers (:data:`ROPE_SCALING_RANGES`), each
EOS id and ``mlp_only_layers`` entry, and (``ModelSpec``) an even number of rotary dimensions
wherever RoPE turns pairs of them. ``docs/validation.md`` lists
the table.
"""

from __future__ import annotations

from kvledger.errors import ConfigError
from kvledger.ranges import Range, check_all

_COUNT = Range(1, 1 << 31, hi_open=True)  # a size of the model: at least one, fits int32
_SIZE = Range(0, 1 << 31, hi_open=True)  # a size that may be 0 (absent)
_TOKEN_ID = Range(0, 1 << 31, hi_open=True, optional=True)
_POSITIVE = Range(0, None, integer=False, lo_open=True)  # a finite number > 0
_NON_NEGATIVE = Range(0, None, integer=False)
_POSITIVE_OR_NONE = Range(0, None, integer=False, lo_open=True, optional=True)

SPEC_RANGES: dict[str, Range] = {
    "num_layers": _COUNT,
    "hidden_size": _COUNT,
    "num_attention_heads": _COUNT,
    "num_kv_heads": _COUNT,
    "head_dim": _COUNT,
    "intermediate_size": _SIZE,
    "vocab_size": _COUNT,
    "max_position_embeddings": _COUNT,
    "final_logit_softcapping": _POSITIVE_OR_NONE,
    "position_embeddings": _SIZE,
    "bos_token_id": _TOKEN_ID,
    "query_pre_attn_scalar": _POSITIVE_OR_NONE,
    "attn_logit_softcapping": _POSITIVE_OR_NONE,
    "attention_multiplier": _POSITIVE_OR_NONE,
    "embedding_multiplier": _POSITIVE,
    "residual_multiplier": _POSITIVE,
    "logits_scaling": _POSITIVE,
    "rope_theta": _POSITIVE,
    "rope_local_base_freq": _POSITIVE_OR_NONE,
    "partial_rotary_factor": Range(0, 1, integer=False, lo_open=True),
    "sliding_window": Range(1, 1 << 31, hi_open=True, optional=True),
    "rms_norm_eps": Range(0, 1, integer=False, lo_open=True, hi_open=True),
    "norms_per_layer": Range(1, 4),
    "num_experts": _SIZE,
    "num_experts_per_tok": _SIZE,
    "moe_intermediate_size": _SIZE,
    "num_shared_experts": _SIZE,
    "shared_expert_intermediate_size": _SIZE,
    "routed_scaling_factor": _POSITIVE,
    "n_group": _SIZE,
    "topk_group": _SIZE,
    "swiglu_limit": _POSITIVE_OR_NONE,
    "swiglu_alpha": _POSITIVE_OR_NONE,
    "kv_lora_rank": _SIZE,
    "q_lora_rank": _SIZE,
    "qk_rope_head_dim": _SIZE,
    "qk_nope_head_dim": _SIZE,
    "v_head_dim": _SIZE,
    "state_conv_dim": _SIZE,
    "state_conv_kernel": _SIZE,
    "mamba_num_heads": _SIZE,
    "mamba_head_dim": _SIZE,
    "mamba_state_size": _SIZE,
    "mamba_n_groups": _SIZE,
    "mamba_chunk_size": _SIZE,
    "linear_num_key_heads": _SIZE,
    "linear_num_value_heads": _SIZE,
    "linear_key_head_dim": _SIZE,
    "linear_value_head_dim": _SIZE,
    "linear_conv_kernel_dim": _SIZE,
    "gguf_tensor_elements": Range(0, 1 << 63, hi_open=True, optional=True),
    "gguf_tensor_bytes": Range(0, 1 << 63, hi_open=True, optional=True),
}
"""Flat field name -> its allowed range."""

ROPE_SCALING_RANGES: dict[str, Range] = {
    "factor": _POSITIVE,
    "original_max_position_embeddings": _COUNT,
    "low_freq_factor": _POSITIVE,
    "high_freq_factor": _POSITIVE,
    "attention_factor": _POSITIVE,
    "beta_fast": _POSITIVE,
    "beta_slow": _POSITIVE,
    "mscale": _NON_NEGATIVE,  # YaRN: <= 0 turns its softmax factor off
    "mscale_all_dim": _NON_NEGATIVE,
}
"""``rope_scaling`` key (when present) -> its allowed range, shown as ``rope_scaling.<key>``."""


def check_spec_fields(fields: dict, where: str = "") -> None:
    """Refuse, naming the field, a value of ``fields`` (flat names) outside its range.

    Raises:
        ConfigError: the first field out of range (``where`` ends the message).
    """
    check_all(SPEC_RANGES, fields, ConfigError, where)
    for i, eos in enumerate(fields.get("eos_token_ids", ())):
        _TOKEN_ID.check(f"eos_token_ids[{i}]", eos, ConfigError, where)
    scaling = fields.get("rope_scaling") or {}
    check_all({f"rope_scaling.{k}": r for k, r in ROPE_SCALING_RANGES.items()},
              {f"rope_scaling.{k}": v for k, v in scaling.items()}, ConfigError, where)
    for layer in fields.get("mlp_only_layers", ()):
        Range(0, fields["num_layers"], hi_open=True).check("mlp_only_layers[]", layer,
                                                           ConfigError, where)
