"""Llama-family decoder forward pass in plain PyTorch, reading and writing the paged KV cache.

Architecture (Touvron et al., "LLaMA", arXiv:2302.13971; GQA: Ainslie et al., arXiv:2305.13245):
token embedding -> N x [RMSNorm -> attention (Q, K, V projections, RoPE on Q and K, GQA) ->
residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head (tied or untied).

For speed on CPU the Q/K/V projections are fused into one matrix and gate/up into another, so a
layer runs four matmuls; in bf16, GGUF Q4 weights also run packed for small batches
(:mod:`kvledger.engine.q4`). RMSNorm is computed in fp32 and cast back, like the Hugging Face
implementation, so fp32 logits match it to ~1e-5 and bf16 follows the same rounding steps.
Q is never cached: only the K/V of new tokens go to the store (seed §2.1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvledger.engine.attention import AttentionBackend, AttentionMetadata, make_backend
from kvledger.engine.kv.store import KVStore
from kvledger.engine.q4 import Linear
from kvledger.engine.rope import RotaryEmbedding
from kvledger.errors import UnsupportedModelError
from kvledger.spec import FULL, ModelSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class LlamaModel:
    """Weights and forward pass of a Llama-family causal LM.

    Args:
        spec: the architecture.
        weights: Hugging Face Llama parameter names -> tensors ([out, in] for projections).
        dtype: compute dtype (torch.float32 or torch.bfloat16).
        attention: an attention backend or its name (see :mod:`kvledger.engine.attention`);
            None takes ``$KVLEDGER_ATTENTION``, else the kernel choice of the probe.

    Raises:
        UnsupportedModelError: the architecture or a layer kind is not a Llama-family one.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 attention: AttentionBackend | str | None = None):
        check_supported(spec)
        self.spec, self.dtype = spec, dtype
        if not isinstance(attention, AttentionBackend):
            attention = make_backend(attention or default_attention_backend())
        self.attention = attention
        w = {name: t.to(dtype) if t.is_floating_point() else t for name, t in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = w.get("lm_head.weight", self.embed)
        self.final_norm = w["model.norm.weight"]
        self.layers = [_fuse_layer(w, f"model.layers.{i}.") for i in range(spec.num_layers)]
        self.packed_q4 = any(layer["qkv"].packed is not None for layer in self.layers)
        self.rope = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                    spec.rope_theta, spec.rope_scaling, dtype)
        self.q_size = spec.num_attention_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, store: KVStore | None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for token ids [T] at positions [T]."""
        spec = self.spec
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rope.lookup(positions)
        heads, kv_heads, dim = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer["input_norm"])
            qkv = layer["qkv"](x)
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, heads + kv_heads, dim)
            qk = self.rope.apply(qk, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(-1, kv_heads, dim)
            attn = self.attention(i, q, k, v, meta, store)
            h = h + layer["o"](attn.reshape(-1, self.q_size))
            x = self._norm(h, layer["post_norm"])
            gate, up = layer["gate_up"](x).chunk(2, dim=-1)
            h = h + layer["down"](F.silu(gate) * up)
        return self._norm(h, self.final_norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32 for hidden states [N, hidden]."""
        return F.linear(hidden, self.lm_head).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.spec.rms_norm_eps)
        return weight * normed.to(self.dtype)


def default_attention_backend() -> str:
    """``$KVLEDGER_ATTENTION`` if set, else ``paged-native`` (falls back to ``paged-torch``)."""
    import os

    return os.environ.get("KVLEDGER_ATTENTION") or "paged-native"


def check_supported(spec: ModelSpec) -> None:
    """Raise UnsupportedModelError unless the engine can run ``spec`` exactly."""
    if spec.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {spec.model_type!r} cannot run in the engine yet (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); `kvledger plan` still sizes it")
    kinds = set(spec.layer_types)
    if kinds != {FULL}:
        raise UnsupportedModelError(
            f"layer kinds {sorted(kinds)} cannot run in the engine yet (full attention only)")


def _fuse_layer(w: dict[str, torch.Tensor], prefix: str) -> dict:
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    qkv = [attn + f"{p}_proj" for p in "qkv"]
    bias = [w.get(stem + ".bias") for stem in qkv]
    return {
        "input_norm": w[prefix + "input_layernorm.weight"],
        "post_norm": w[prefix + "post_attention_layernorm.weight"],
        "qkv": _fused_linear(w, qkv, torch.cat(bias) if bias[0] is not None else None),
        "o": _fused_linear(w, [attn + "o_proj"]),
        "gate_up": _fused_linear(w, [mlp + "gate_proj", mlp + "up_proj"]),
        "down": _fused_linear(w, [mlp + "down_proj"]),
    }


def _fused_linear(w: dict[str, torch.Tensor], stems: list[str],
                  bias: torch.Tensor | None = None) -> Linear:
    """One Linear over the row-concatenation of several projections (and their 4-bit forms)."""
    weight = torch.cat([w[s + ".weight"] for s in stems]).contiguous()
    q4 = None
    if all(s + ".q4_codes" in w for s in stems):
        q4 = tuple(torch.cat([w[s + part] for s in stems])
                   for part in (".q4_codes", ".q4_scale", ".q4_zero"))
    return Linear(weight, bias, q4)
