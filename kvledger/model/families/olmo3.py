"""OLMo 3 (``model_type: olmo3``; Team OLMo, "Olmo 3", 2025; transformers' ``Olmo3Model``): the
Llama decoder with OLMo 2's changes and sliding layers:

- no norm before attention or the MLP: each sublayer's output is RMSNormed before it joins the
  residual (``post_attention_layernorm``, ``post_feedforward_layernorm``), then the final norm;
- q and k RMSNormed over the whole projection (weights [heads x head_dim] and [kv_heads x
  head_dim]) before RoPE;
- three sliding layers (window 4096) then a full one (``layer_types``; a config without them:
  every 4th layer full, ``Olmo3Config``);
- RoPE per layer kind: the full layers' scaling (YaRN, factor 8, on the released 7B and 32B),
  the sliding layers' the base alone (``rope_local_base_freq``), as transformers 4.57 and 5
  place it (``Olmo3RotaryEmbedding`` per layer type; 5.2.0 scaled every layer, a regression).
"""

from __future__ import annotations

from functools import cache

from kvledger.spec import (
    SLIDING,
    Config,
    Family,
    ModelSpec,
    any_value,
    every_nth_full,
    full_and_sliding,
    rope_types,
)


def _config_fields(c: Config, n: int) -> dict:
    """q / k norms over the whole projection; the sliding layers' RoPE base, unscaled (a
    transformers 4 config's ``rope_scaling`` scales the full layers only)."""
    params = c.get("rope_parameters") or {}
    local = (params.get(SLIDING) or {}).get("rope_theta",
                                             params.get("rope_theta", c.get("rope_theta")))
    return {"qk_norm": True, "qk_norm_full_width": True, "rope_local_base_freq": float(local)}


def _layer_types(c: Config, n: int) -> tuple[str, ...]:
    return every_nth_full(4, n)


def _tensor_shapes(spec: ModelSpec, shapes: dict) -> dict:
    """The norm after the MLP instead of the one before attention."""
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        del shapes[p + "input_layernorm.weight"]
        shapes[p + "post_feedforward_layernorm.weight"] = (spec.hidden_size,)
    return shapes


@cache
def _model() -> type:
    from kvledger.model.layers.decoder import Decoder

    class Olmo3Decoder(Decoder):
        """The decoder with OLMo's post-norms only (module docstring)."""

        def norm_names(self) -> dict[str, str]:
            return {"attn_out_norm": "post_attention_layernorm",
                    "mlp_out_norm": "post_feedforward_layernorm"}

    return Olmo3Decoder


FAMILY = Family(
    name="olmo3",
    model_types=("olmo3",),
    runs={"layer_types": full_and_sliding, "sliding_window": any_value, "qk_norm": any_value,
          "qk_norm_full_width": any_value, "rope_local_base_freq": any_value,
          "rope_scaling": rope_types("default", "linear", "llama3", "yarn")},
    config_defaults={"olmo3": {"rope_theta": 500_000.0, "sliding_window": 4096,
                               "eos_token_id": 50279}},
    config_fields=_config_fields,
    layer_types=_layer_types,
    tensor_shapes=_tensor_shapes,
    model=_model,
)
