"""gpt-oss: the Llama decoder with routed experts and OpenAI's changes (OpenAI, "gpt-oss-120b &
gpt-oss-20b Model Card", 2025; transformers' ``GptOssModel``):

- biases on the q, k, v and o projections;
- learned sink logits, one per query head, in every attention softmax's denominator (no KV),
  handed to the attention backend per layer;
- alternating sliding (window 128) and full layers (``layer_types``; the hybrid pool);
- YaRN RoPE (``kvledger.model.layers.rotary``);
- the router: a Linear with bias, the top-k of its logits, softmaxed over those k (the same
  weights as the softmax over all experts renormalised over the top k: ``norm_topk_prob``);
- experts with biases and the clamped SwiGLU ``(clamp(up, -l, l) + 1) g sigmoid(a g)``,
  ``g = min(gate, l)``, l = ``swiglu_limit`` (7), a = ``swiglu_alpha`` (1.702)
  (:meth:`kvledger.device.ops.TorchOps.clamped_swiglu`).

Weights: the router ``mlp.router`` -> ``mlp.gate``; the stacked ``mlp.experts.gate_up_proj``
[experts, hidden, 2f] (used as ``x @ W``, gate and up in alternate columns) and ``down_proj``
[experts, f, hidden] with their ``*_bias`` -> per expert ``gate_proj`` / ``up_proj`` /
``down_proj`` [out, in] views (``GptOssExperts``); MXFP4 ``*_blocks`` / ``*_scales`` are
dequantized first (``kvledger.model.weights.mxfp4``). GGUF (``gpt-oss``): even layers slide;
the clamped SwiGLU's 7.0 and 1.702 are constants of llama.cpp's graph
(``src/models/openai-moe.cpp``); its YaRN correction range is floored and ceiled
(``ggml_rope_yarn_corr_dims``: HF's ``truncate``, which transformers' gpt-oss config turns
off: the two differ slightly); ``attn_sinks`` are the sinks.
"""

from __future__ import annotations

from kvledger.model.layers import plain_decoder
from kvledger.spec import (
    Config,
    Family,
    GGUFHeader,
    ModelSpec,
    any_value,
    every_nth_full,
    full_and_sliding,
    is_,
    is_set,
    rope_types,
)


def _config_fields(c: Config, n: int) -> dict:
    from kvledger.model.families.moe import experts_key

    return {"num_experts": c.int(experts_key(c)),
            "num_experts_per_tok": int(c.get("num_experts_per_tok")
                                       or c.req("experts_per_token")),
            "moe_intermediate_size": c.int("intermediate_size"), "router_bias": True,
            "norm_topk_prob": True, "mlp_bias": True, "attention_sinks": True,
            "swiglu_limit": float(c.get("swiglu_limit", 7.0)),  # GptOssConfig's defaults
            "swiglu_alpha": float(c.get("swiglu_alpha", 1.702))}


def _layer_types(c: Config, n: int) -> tuple[str, ...]:
    return every_nth_full(2, n)


def _gguf_fields(header: GGUFHeader, fields: dict) -> dict:
    names = header.tensor_names
    return {"router_bias": "blk.0.ffn_gate_inp.bias" in names,
            "attention_sinks": "blk.0.attn_sinks.weight" in names,
            "mlp_bias": "blk.0.ffn_gate_exps.bias" in names,
            "swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def _weight_names(state: dict, spec: ModelSpec) -> None:
    """Sinks (a GGUF's ``attn_sinks.weight``), router and stacked experts of every layer ->
    the common names (module docstring)."""
    from kvledger.model.weights.mxfp4 import dequantize_experts

    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        if p + "self_attn.sinks.weight" in state:
            state[p + "self_attn.sinks"] = state.pop(p + "self_attn.sinks.weight")
        mlp = p + "mlp."
        for suffix in (".weight", ".bias"):
            if mlp + "router" + suffix in state:
                state[mlp + "gate" + suffix] = state.pop(mlp + "router" + suffix)
        dequantize_experts(state, mlp + "experts.")
        gate_up = state.pop(mlp + "experts.gate_up_proj", None)
        if gate_up is None:
            continue
        down = state.pop(mlp + "experts.down_proj")
        bias = state.pop(mlp + "experts.gate_up_proj_bias")
        down_bias = state.pop(mlp + "experts.down_proj_bias")
        for e in range(gate_up.shape[0]):
            stem = f"{mlp}experts.{e}."
            state |= {stem + "gate_proj.weight": gate_up[e, :, 0::2].T,
                      stem + "up_proj.weight": gate_up[e, :, 1::2].T,
                      stem + "gate_proj.bias": bias[e, 0::2],
                      stem + "up_proj.bias": bias[e, 1::2],
                      stem + "down_proj.weight": down[e].T, stem + "down_proj.bias": down_bias[e]}


FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    runs={"layer_types": full_and_sliding, "sliding_window": any_value, "o_bias": any_value,
          "num_experts": any_value, "num_experts_per_tok": any_value,
          "moe_intermediate_size": any_value, "rope_scaling": rope_types("default", "yarn"),
          "router_bias": is_(True), "mlp_bias": is_(True), "attention_sinks": is_(True),
          "swiglu_limit": is_set, "swiglu_alpha": is_set,
          "norm_topk_prob": any_value},  # biased experts, sinks
    config_fields=_config_fields,
    layer_types=_layer_types,
    gguf_archs={"gpt-oss": "gpt_oss"},
    gguf_fields=_gguf_fields,
    gguf_sliding_period={"gpt-oss": 2},
    gguf_tensors={"post_attention_norm": "post_attention_layernorm",
                  "attn_sinks": "self_attn.sinks"},
    weight_names=_weight_names,
    model=plain_decoder,
)
