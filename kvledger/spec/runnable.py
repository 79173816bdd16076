"""Which models the engine runs exactly: no silently wrong model. The one place that decides.

Every :class:`ModelSpec` field, a group's by its flat name (``num_experts`` for
``experts.count``, :meth:`ModelSpec.as_fields`), falls in one of three lists
(``tests/spec/test_runnable.py`` walks the groups and fails when a new field is in none):

- :data:`IMPLEMENTED`: every family's forward pass honours every value (logits checked against
  transformers: ``tests/model/test_llama.py``, ``tests/model/test_family_oracle.py``);
- :data:`ONLY_AT`: the field changes the forward, and the engine runs only the values listed:
  the plain Llama decoder's, widened per family by its descriptor's ``runs``
  (``kvledger.model.families``; each checked by its family's oracle); any other value is
  refused at load, by name, before weights are read;
- :data:`NOT_FORWARD`: names, token ids and file facts that do not change what is computed.

The predicates (:func:`is_`, :func:`any_value`, ...) are what a family's ``runs`` is written
in. Torch-free; :func:`check_runnable` takes the family table as a parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.errors import UnsupportedModelError
from kvledger.spec.family import FamilyTable
from kvledger.spec.groups import FULL, SLIDING
from kvledger.spec.model_spec import ModelSpec

IMPLEMENTED = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
    "rms_norm_eps", "rope_theta", "qkv_bias",
})


def is_(*values: Any) -> Callable[[Any], bool]:
    """Runs exactly ``values``."""
    return lambda value: value in values


def any_value(value: Any) -> bool:
    """Runs every value."""
    return True


def is_set(value: Any) -> bool:
    """Runs every value but None."""
    return value is not None


def rope_types(*types: str) -> Callable[[Any], bool]:
    """Runs a ``rope_scaling`` of one of ``types`` (None: ``default``)."""
    return lambda scaling: (scaling or {}).get("rope_type", "default") in types


def leading(layers: tuple[int, ...]) -> bool:
    """Runs layer indices 0 .. k-1 (DeepSeek's ``first_k_dense_replace`` dense layers)."""
    return layers == tuple(range(len(layers)))


def full_and_sliding(kinds: tuple[str, ...]) -> bool:
    """Runs full and sliding layers, each its own window."""
    return set(kinds) <= {FULL, SLIDING}


ONLY_AT: dict[str, Callable[[Any], bool]] = {
    "model_type": any_value,  # the family table decides (check_runnable)
    "rope_scaling": rope_types("default", "linear", "llama3"),
    "rope_local_base_freq": is_(None),
    "partial_rotary_factor": is_(1.0),
    "position_embedding_type": is_("rope"),
    "layer_types": lambda kinds: set(kinds) == {FULL},
    "sliding_window": is_(None),
    "hidden_act": is_("silu", "swish"),  # transformers' ACT2FN: both are SiLU
    "query_pre_attn_scalar": is_(None),
    "attn_logit_softcapping": is_(None),
    "attention_multiplier": is_(None),
    "embedding_multiplier": is_(1.0),
    "residual_multiplier": is_(1.0),
    "logits_scaling": is_(1.0),
    "final_logit_softcapping": is_(None),
    "weights_dtype": is_("fp32", "fp16", "bf16"),  # fp8 needs its scales applied
    "mlp_gated": is_(True),
    "o_bias": is_(False),
    "mlp_bias": is_(False),
    "norm_bias": is_(False),
    "norms_per_layer": is_(2),
    "qk_norm": is_(False),
    "qk_norm_full_width": is_(False),
    "attn_output_gate": is_(False),
    "attention_sinks": is_(False),
    "position_embeddings": is_(0),
    "num_experts": is_(0),
    "num_experts_per_tok": is_(0),
    "moe_intermediate_size": is_(0),
    "num_shared_experts": is_(0),
    "shared_expert_intermediate_size": is_(0),
    "mlp_only_layers": is_(()),
    "router_bias": is_(False),
    "swiglu_limit": is_(None),
    "swiglu_alpha": is_(None),
    "shared_expert_gate": is_(False),
    "norm_topk_prob": is_(False),
    "routed_scaling_factor": is_(1.0),
    "topk_method": is_("greedy"),
    "n_group": is_(0),
    "topk_group": is_(0),
    "kv_lora_rank": is_(0),
    "q_lora_rank": is_(0),
    "qk_rope_head_dim": is_(0),
    "qk_nope_head_dim": is_(0),
    "v_head_dim": is_(0),
    "linear_num_key_heads": is_(0),
    "linear_num_value_heads": is_(0),
    "linear_key_head_dim": is_(0),
    "linear_value_head_dim": is_(0),
    "linear_conv_kernel_dim": is_(0),
    "state_conv_dim": is_(0),
    "state_conv_kernel": is_(0),
    "state_recurrent_shape": is_(()),
    "state_conv_bias": is_(False),
    "mamba_num_heads": is_(0),
    "mamba_head_dim": is_(0),
    "mamba_state_size": is_(0),
    "mamba_n_groups": is_(0),
    "mamba_chunk_size": is_(0),
    "mamba_proj_bias": is_(False),
    "time_step_limit": is_((0.0, None)),
}
"""Field -> the values the plain Llama decoder runs (SwiGLU, RMSNorm, full attention)."""

NOT_FORWARD = frozenset({
    "name", "bos_token_id", "eos_token_ids", "gguf_tensor_elements", "gguf_tensor_bytes",
    "source", "extra",
})


def _shown(value: Any) -> str:
    return repr(sorted(set(value))) if isinstance(value, tuple) else repr(value)


def check_runnable(spec: ModelSpec, families: FamilyTable) -> str:
    """Refuse a spec the engine would not compute exactly; return its family's name.

    Raises:
        UnsupportedModelError: naming the model type and the types the engine runs, or
            every field whose value the family does not run (``field=value``).
    """
    where = spec.source or spec.name
    family = families.of_type(spec.model_type)
    if family is None or not family.runs_in_engine or spec.model_type not in family.model_types:
        what = f" ({family.what})" if family is not None and family.what else ""
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r}{what} in {where} cannot run in the engine yet (it "
            f"runs {', '.join(families.engine_model_types)}); `kvledger plan` still sizes it")
    allowed = {**ONLY_AT, **family.runs}
    values = spec.as_fields()
    bad = [f"{name}={_shown(values[name])}" for name, ok in allowed.items()
           if not ok(values[name])]
    if bad:
        raise UnsupportedModelError(
            f"{where}: the engine cannot run {', '.join(bad)} yet (its {spec.model_type} "
            "forward pass would compute another model); `kvledger plan` still sizes it")
    return family.name
