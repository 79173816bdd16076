"""Which models the engine runs exactly: no silently wrong model.

Every :class:`ModelSpec` field falls in one of three lists (``tests/spec/test_runnable.py``
fails when a new field is in none):

- :data:`IMPLEMENTED`: the engine's forward pass honours every value (logits checked against
  transformers: ``tests/model/test_llama.py``, ``tests/model/test_runnable_models.py``);
- :data:`ONLY_AT`: the field changes the forward, and the engine runs only the values listed
  (the Llama decoder's); any other value is refused at load, by name, before weights are read;
- :data:`NOT_FORWARD`: names, token ids and file facts that do not change what is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvledger.errors import UnsupportedModelError
from kvledger.spec.model_spec import FULL, ModelSpec

# families whose decoder the engine runs (others are sized by `kvledger plan` only)
ENGINE_MODEL_TYPES = ("llama", "mistral", "qwen2")

IMPLEMENTED = frozenset({
    "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
    "rms_norm_eps", "rope_theta", "rope_scaling", "qkv_bias",
})


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


ONLY_AT: dict[str, Callable[[Any], bool]] = {
    "model_type": _is(*ENGINE_MODEL_TYPES),
    "layer_types": lambda kinds: set(kinds) == {FULL},
    "sliding_window": _is(None),
    "hidden_act": _is("silu", "swish"),  # transformers' ACT2FN: both are SiLU
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
    "first_k_dense_layers": _is(0),
    "router_bias": _is(False),
    "shared_expert_gate": _is(False),
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

NOT_FORWARD = frozenset({
    "name", "bos_token_id", "eos_token_ids", "gguf_tensor_elements", "gguf_tensor_bytes",
    "source", "extra",
})


def _shown(value: Any) -> str:
    return repr(sorted(set(value))) if isinstance(value, tuple) else repr(value)


def check_runnable(spec: ModelSpec) -> None:
    """Refuse a spec the engine would not compute exactly.

    Raises:
        UnsupportedModelError: naming the family, or every field outside :data:`ONLY_AT`.
    """
    where = spec.source or spec.name
    if spec.model_type not in ENGINE_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r} in {where} cannot run in the engine yet (it runs "
            f"{', '.join(ENGINE_MODEL_TYPES)}); `kvledger plan` still sizes it")
    bad = [f"{name}={_shown(getattr(spec, name))}" for name, ok in ONLY_AT.items()
           if not ok(getattr(spec, name))]
    if bad:
        raise UnsupportedModelError(
            f"{where}: the engine cannot run {', '.join(bad)} yet (its {spec.model_type} "
            "forward pass would compute another model); `kvledger plan` still sizes it")
