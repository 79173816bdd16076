"""Self-attention's projections around the attention backend: q, k, v out of one fused Linear,
their norms, RoPE on q and k, and the output projection (Vaswani et al., arXiv:1706.03762;
GQA: Ainslie et al., arXiv:2305.13245).

Options, each switched on by the spec and its weights:

- q / k RMSNorm before RoPE, per head (weights [head_dim]: Qwen3, Gemma 3) or over the whole
  projection (``qk_norm_full_width``, weights [heads x head_dim]: OLMo 2 / 3);
- biases on q, k, v and o (Qwen2, gpt-oss);
- RoPE on the first ``rotary_dim`` dimensions of each head (:mod:`.rotary`), or none (a
  ``nope`` spec's layer has no table: Granite-4.0-H);
- learned sink logits, one per query head (gpt-oss), handed to the backend;
- an output gate (Qwen3.5, Qwen3-Next: ``attn_output_gate``): q_proj's rows hold, head by
  head, the head's q then its gate; the gate rows go to the end of the fused projection and
  the attention output is multiplied by their sigmoid before o_proj.

What the backend applies per layer (score scale, sliding window, soft-capping, sink logits) is
its ``LayerAttention`` (``kvledger.engine.attention.layer``), set by the engine from the spec;
:meth:`SelfAttention.backend_params` adds what the layer's weights hold (the sinks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvledger.model.layers.linears import held_bytes
from kvledger.model.layers.rotary import RotaryEmbedding
from kvledger.model.linear import Linear
from kvledger.spec import ModelSpec


class SelfAttention:
    """One layer's self-attention (module docstring).

    Args:
        spec: the architecture; w: the weights (its ``{prefix}self_attn.*`` entries are
            popped); linear: ``(stems, shape class) -> Linear`` of the row-concatenated
            projections; norm: ``(weight, dtype) -> `` the weight as the model holds a norm's;
        rope: this layer's RoPE table (None: no position embedding); ops: the device's fused ops (``rope_``); dtype: the
            compute dtype.
    """

    def __init__(self, spec: ModelSpec, w: dict, prefix: str,
                 linear: Callable[[list[str], str], Linear], norm, rope: RotaryEmbedding | None,
                 ops, dtype: torch.dtype) -> None:
        attn = prefix + "self_attn."
        self.spec, self.rope, self.ops = spec, rope, ops
        self.gated = spec.attention.output_gate
        if self.gated:
            split_output_gate(w, attn, spec.num_attention_heads, spec.head_dim)
        gate = [attn + "gate_proj"] if self.gated else []
        self.qkv = linear([attn + f"{p}_proj" for p in "qkv"] + gate, "qkv")
        self.o = linear([attn + "o_proj"], "o")
        self.q_norm = self.k_norm = self.sinks = None
        if spec.attention.qk_norm:  # they go through F.rms_norm on compute rows
            self.q_norm = norm(w.pop(attn + "q_norm.weight"), dtype)
            self.k_norm = norm(w.pop(attn + "k_norm.weight"), dtype)
        if spec.attention.sinks:
            self.sinks = w.pop(attn + "sinks").float()

    def backend_params(self, how):
        """The backend's ``LayerAttention`` of this layer: the engine's, with the sinks."""
        return how if self.sinks is None else dataclasses.replace(how, sinks=self.sinks)

    def __call__(self, index: int, x: torch.Tensor, positions: torch.Tensor, backend, meta,
                 store) -> torch.Tensor:
        """The attention output [T, hidden] of normed hidden states x [T, hidden] at positions
        [T], layer ``index`` of ``backend`` (``meta``: the step's ``AttentionMetadata``;
        ``store``: the KV store or None)."""
        qkv = self.qkv(x)
        q, k, v = self.project(qkv, positions)
        q_size = self.spec.num_attention_heads * self.spec.head_dim
        out = backend(index, q, k, v, meta, store).reshape(-1, q_size)
        return self.o(self.output_gate(out, qkv) if self.gated else out)

    def output_gate(self, out: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """The attention output [T, heads x D] times the sigmoid of the gate, the last rows
        of the fused projection ``qkv``."""
        return out * torch.sigmoid(qkv[:, -out.shape[1]:])

    def project(self, qkv: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D] out of the fused projection's rows
        ``qkv``: the q / k norms, RoPE on q and k together (when the layer has a table)."""
        spec = self.spec
        eps, heads, kv_heads, dim = spec.norm.eps, spec.num_attention_heads, \
            spec.num_kv_heads, spec.head_dim
        q_size, kv_size = heads * dim, kv_heads * dim
        qk = qkv[:, : q_size + kv_size].view(-1, heads + kv_heads, dim)
        if self.q_norm is not None:  # written back into qkv: RoPE then turns q, k in place
            if spec.attention.qk_norm_full_width:
                flat = qkv[:, : q_size + kv_size]
                flat[:, :q_size] = F.rms_norm(flat[:, :q_size], (q_size,), self.q_norm, eps)
                flat[:, q_size:] = F.rms_norm(flat[:, q_size:], (kv_size,), self.k_norm, eps)
            else:
                qk[:, :heads] = F.rms_norm(qk[:, :heads], (dim,), self.q_norm, eps)
                qk[:, heads:] = F.rms_norm(qk[:, heads:], (dim,), self.k_norm, eps)
        if self.rope is not None:
            qk = self.ops.rope_(qk, positions, self.rope)
        v = qkv[:, q_size + kv_size: q_size + 2 * kv_size].view(-1, kv_heads, dim)
        return qk[:, :heads], qk[:, heads:], v

    def linears(self, shape_class: str) -> list[Linear]:
        """Its Linears of ``qkv`` or ``o`` (``[]`` for another class)."""
        return {"qkv": [self.qkv], "o": [self.o]}.get(shape_class, [])

    @property
    def decode_bytes(self) -> int:
        """Weight bytes one decode step reads: both Linears, whole."""
        return self.qkv.nbytes + self.o.nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes of every tensor held (biases, norms and sinks included)."""
        vectors = [t for t in (self.q_norm, self.k_norm, self.sinks) if t is not None]
        return held_bytes(self.qkv) + held_bytes(self.o) + sum(t.nbytes for t in vectors)


def split_output_gate(w: dict, attn: str, heads: int, dim: int) -> None:
    """``{attn}q_proj`` of [heads x (q, gate) x dim] rows (and its bias) rewritten in place as
    ``{attn}q_proj`` (the q rows) and ``{attn}gate_proj`` (the gate rows), both head by head."""
    for kind in ("weight", "bias"):
        both = w.pop(f"{attn}q_proj.{kind}", None)
        if both is None:
            continue
        q, gate = both.reshape(heads, 2, dim, -1).unbind(1)
        w[f"{attn}q_proj.{kind}"] = q.reshape(heads * dim, *both.shape[1:]).contiguous()
        w[f"{attn}gate_proj.{kind}"] = gate.reshape(heads * dim, *both.shape[1:]).contiguous()
