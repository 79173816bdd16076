"""Self-attention's projections around the attention backend: q, k, v out of one fused Linear,
their norms, RoPE on q and k, and the output projection (Vaswani et al., arXiv:1706.03762;
GQA: Ainslie et al., arXiv:2305.13245).

Options, each switched on by the spec and its weights:

- q / k RMSNorm before RoPE, per head (weights [head_dim]: Qwen3, Gemma 3) or over the whole
  projection (``qk_norm_full_width``, weights [heads x head_dim]: OLMo 2 / 3);
- biases on q, k, v and o (Qwen2, gpt-oss);
- RoPE on the first ``rotary_dim`` dimensions of each head (:mod:`.rotary`).

What the backend applies per layer (score scale, sliding window, soft-capping, sink logits) is
its ``LayerAttention`` (``kvledger.engine.attention.layer``), set by the engine from the spec;
a family whose sinks are weights hands them over with :func:`with_sinks`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvledger.model.layers.linears import fused_linear
from kvledger.model.layers.rotary import RotaryEmbedding
from kvledger.spec import ModelSpec


def attention_linears(w: dict[str, torch.Tensor], prefix: str, formats: dict[str, str],
                      release, dtype: torch.dtype, kernels) -> dict:
    """One layer's fused Linears ``qkv`` (q, k, v rows) and ``o``, ``prefix`` its
    ``model.layers.{i}.``."""
    attn = prefix + "self_attn."
    return {
        "qkv": fused_linear(w, [attn + f"{p}_proj" for p in "qkv"], formats.get("qkv", "dense"),
                            release, dtype, kernels),
        "o": fused_linear(w, [attn + "o_proj"], formats.get("o", "dense"), release, dtype,
                          kernels),
    }


def project_qkv(layer: dict, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                spec: ModelSpec, ops) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, heads, D], k and v [T, kv_heads, D] of normed hidden states x [T, hidden]: one
    fused projection, the q / k norms if the layer has them (``q_norm`` / ``k_norm``: per head,
    or over the whole projection when ``spec.qk_norm_full_width``), RoPE on q and k together
    (``ops.rope_``)."""
    eps, heads, kv_heads, dim = spec.rms_norm_eps, spec.num_attention_heads, \
        spec.num_kv_heads, spec.head_dim
    q_size, kv_size = heads * dim, kv_heads * dim
    qkv = layer["qkv"](x)
    qk = qkv[:, : q_size + kv_size].view(-1, heads + kv_heads, dim)
    if "q_norm" in layer:  # written back into qkv: RoPE then turns q and k in place
        q_norm, k_norm = layer["q_norm"], layer["k_norm"]
        if not spec.qk_norm_full_width:
            qk[:, :heads] = F.rms_norm(qk[:, :heads], (dim,), q_norm, eps)
            qk[:, heads:] = F.rms_norm(qk[:, heads:], (dim,), k_norm, eps)
        else:
            flat = qkv[:, : q_size + kv_size]
            flat[:, :q_size] = F.rms_norm(flat[:, :q_size], (q_size,), q_norm, eps)
            flat[:, q_size:] = F.rms_norm(flat[:, q_size:], (kv_size,), k_norm, eps)
    qk = ops.rope_(qk, positions, rope)
    v = qkv[:, q_size + kv_size:].view(-1, kv_heads, dim)
    return qk[:, :heads], qk[:, heads:], v


def with_sinks(attention, sinks: list[torch.Tensor]) -> None:
    """Give the backend ``attention`` each layer's sink logits [heads] (fp32), keeping the
    per-layer parameters the engine set."""
    attention.set_layers([dataclasses.replace(how, sinks=layer_sinks)
                          for how, layer_sinks in zip(attention.layers, sinks)])
