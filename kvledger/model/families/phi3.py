"""Phi-3 / Phi-4-mini (``model_type: phi3``): the Llama decoder with a uniform sliding window,
a partial rotary factor (Phi-4-mini turns 0.75 of each head) and LongRoPE (Microsoft, "Phi-3
Technical Report", arXiv:2404.14219; transformers' ``Phi3Model``).

The checkpoint's fused ``qkv_proj`` and ``gate_up_proj`` (gate rows first, as ``Phi3MLP``
chunks them; a GGUF's ``attn_qkv`` / ``ffn_up``) are split into the common names when loaded
and fused again like any layer's. LongRoPE's short or long factors are chosen once, from the
max model length (``kvledger.model.layers.rotary``); a GGUF stores them as the
``rope_factors_long`` / ``_short`` tensors, which the generic reader takes.
"""

from __future__ import annotations

from kvledger.model.layers import plain_decoder
from kvledger.spec import (
    Family,
    ModelSpec,
    any_value,
    full_and_sliding,
    rope_types,
    uniform_window,
)


def _weight_names(state: dict, spec: ModelSpec) -> None:
    """The fused projections -> the separate ones, as row views (with a GGUF's 4-bit parts)."""
    from kvledger.model.weights.names import split_rows

    d, q, kv, f = spec.head_dim, spec.num_attention_heads, spec.num_kv_heads, \
        spec.intermediate_size
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        split_rows(state, p + "self_attn.qkv_proj", [
            (p + f"self_attn.{n}_proj", rows) for n, rows in (("q", q * d), ("k", kv * d),
                                                              ("v", kv * d))])
        split_rows(state, p + "mlp.gate_up_proj", [(p + "mlp.gate_proj", f),
                                                   (p + "mlp.up_proj", f)])


FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    runs={"layer_types": full_and_sliding, "sliding_window": any_value,
          "partial_rotary_factor": any_value,
          "rope_scaling": rope_types("default", "linear", "llama3", "longrope")},
    layer_types=uniform_window,
    gguf_archs={"phi3": "phi3"},
    gguf_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    weight_names=_weight_names,
    model=plain_decoder,
)
