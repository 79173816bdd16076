"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434 §2.1; transformers'
``DeepseekV2Attention``): one layer's weights, its cached entry and the absorbed attention.

Per token x [hidden], heads H, ``nope`` / ``rope`` / ``v`` head dims, latent rank L:

- query: ``q_b(RMSNorm(q_a(x)))`` when ``q_lora_rank`` is set (V2), else ``q_proj(x)``
  (V2-Lite) -> [H, nope + rope], split into ``q_nope`` and ``q_pe``;
- ``kv_a_proj_with_mqa(x)`` -> ``c_KV`` [L] and ``k_pe`` [rope]; the cached entry is
  ``kv_a_layernorm(c_KV) ++ RoPE(k_pe)`` [L + rope], one per token, shared by every head
  (``engine/kv/latent_store.py``);
- ``kv_b_proj`` [H * (nope + v), L] holds per head ``W_UK`` [nope, L] and ``W_UV`` [v, L]:
  head h's key is ``W_UK_h c ++ k_pe``, its value ``W_UV_h c``.

Absorbed (the paper's §2.1.2 "absorb"): ``q . k = (W_UK_h^T q_nope) . c + q_pe . k_pe``, so
the query becomes ``W_UK_h^T q_nope ++ q_pe`` [L + rope] and attention runs as one KV head of
width L + rope over the cached entries themselves (the backends' GQA with a group of H); its
output over the entries, whose first L values are the latent, is multiplied by ``W_UV_h``
before ``o_proj``. Cached tokens are never expanded per head, in decode and prefill alike,
and each step reads the latent pool once for all heads. The softmax scale stays
``(nope + rope) ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2``
(:func:`kvledger.model.layers.rotary.yarn_softmax_factor`).

RoPE turns interleaved pairs ``(x_{2i}, x_{2i+1})`` (transformers' complex form,
``apply_rotary_emb``; :class:`~kvledger.model.layers.rotary.InterleavedRope`), not Llama's
halves. The two RMSNorms inside attention use eps 1e-6, the
default of transformers' ``DeepseekV2RMSNorm`` (the config's ``rms_norm_eps`` is not passed).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvledger.model.layers.linears import held_bytes
from kvledger.model.layers.rotary import InterleavedRope, yarn_softmax_factor
from kvledger.model.linear import Linear
from kvledger.spec import ModelSpec

LATENT_NORM_EPS = 1e-6


class LatentAttention:
    """One MLA layer's projections (module docstring).

    Args:
        spec: the architecture; w: the weights (its ``{prefix}self_attn.*`` entries are popped);
        linear: ``(stems, shape class) -> Linear`` of the row-concatenated projections;
        rope: the interleaved RoPE of the ``rope`` dims; dtype: the compute dtype.
    """

    def __init__(self, spec: ModelSpec, w: dict, prefix: str, linear, rope: InterleavedRope,
                 dtype: torch.dtype):
        attn = prefix + "self_attn."
        self.rope, self.softmax_factor = rope, yarn_softmax_factor(spec.rope.scaling)
        self.heads, self.latent = spec.num_attention_heads, spec.latent.kv_lora_rank
        self.nope, self.rope_dim = spec.latent.qk_nope_head_dim, spec.latent.qk_rope_head_dim
        self.v_dim = spec.latent.v_head_dim
        if spec.latent.q_lora_rank:
            self.q_a = linear([attn + "q_a_proj"], "qkv")
            self.q_a_norm = w.pop(attn + "q_a_layernorm.weight").to(dtype)
            self.q_b = linear([attn + "q_b_proj"], "qkv")
        else:
            self.q_a, self.q_a_norm, self.q_b = None, None, linear([attn + "q_proj"], "qkv")
        self.kv_a = linear([attn + "kv_a_proj_with_mqa"], "qkv")
        self.kv_a_norm = w.pop(attn + "kv_a_layernorm.weight").to(dtype)
        kv_b = w.pop(attn + "kv_b_proj.weight").to(dtype)
        kv_b = kv_b.view(self.heads, self.nope + self.v_dim, self.latent)
        self.w_uk = kv_b[:, : self.nope].contiguous()  # [H, nope, L]
        self.w_uv = kv_b[:, self.nope:].contiguous()  # [H, v, L]
        self.o = linear([attn + "o_proj"], "o")

    def backend_params(self, how):
        """The backend's ``LayerAttention`` of this layer: the engine's, its scale times YaRN's
        softmax factor (module docstring)."""
        return dataclasses.replace(how, scale=how.scale * self.softmax_factor)

    def __call__(self, index: int, x: torch.Tensor, positions: torch.Tensor, backend, meta,
                 store) -> torch.Tensor:
        """The attention output [T, hidden] of normed hidden states x [T, hidden] at positions
        [T]: the absorbed queries over the cached entries, layer ``index`` of ``backend``."""
        q, entry = self.query_and_entry(x, positions, self.rope)
        return self.output(backend(index, q, entry, entry, meta, store))

    def linears(self, shape_class: str) -> list[Linear]:
        """Its Linears of ``qkv`` (the q and kv_a projections) or ``o`` (``[]`` for another
        class; the absorbed ``kv_b`` is not a Linear)."""
        if shape_class == "o":
            return [self.o]
        qkv = [lin for lin in (self.q_a, self.q_b, self.kv_a) if lin is not None]
        return qkv if shape_class == "qkv" else []

    @property
    def decode_bytes(self) -> int:
        """Weight bytes one decode step reads: its Linears and ``W_UK`` / ``W_UV``, whole."""
        linears = self.linears("qkv") + self.linears("o")
        return sum(lin.nbytes for lin in linears) + self.w_uk.nbytes + self.w_uv.nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes of every tensor held (norms included)."""
        norms = [t for t in (self.q_a_norm, self.kv_a_norm) if t is not None]
        return sum(held_bytes(lin) for lin in self.linears("qkv") + self.linears("o")) + \
            self.w_uk.nbytes + self.w_uv.nbytes + sum(t.nbytes for t in norms)

    def query_and_entry(self, x: torch.Tensor, positions: torch.Tensor,
                        rope: InterleavedRope) -> tuple[torch.Tensor, torch.Tensor]:
        """(absorbed queries [T, H, L + rope], cached entries [T, 1, L + rope]) of normed hidden
        states x [T, hidden] at positions [T]."""
        if self.q_a is not None:
            q = self.q_b(F.rms_norm(self.q_a(x), (self.q_a_norm.shape[0],), self.q_a_norm,
                                    LATENT_NORM_EPS))
        else:
            q = self.q_b(x)
        q = q.view(-1, self.heads, self.nope + self.rope_dim)
        q_latent = torch.einsum("thn,hnl->thl", q[..., : self.nope], self.w_uk)
        q_pe = rope(q[..., self.nope:], positions)
        kv = self.kv_a(x)
        c_kv = F.rms_norm(kv[:, : self.latent], (self.latent,), self.kv_a_norm, LATENT_NORM_EPS)
        k_pe = rope(kv[:, None, self.latent:], positions)
        entry = torch.cat((c_kv[:, None], k_pe), dim=-1)
        return torch.cat((q_latent, q_pe), dim=-1), entry

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of ``W_UV`` applied per head to the attention over the entries
        [T, H, L + rope] (their first L values, the latent) -> [T, hidden]."""
        values = torch.einsum("thl,hvl->thv", attended[..., : self.latent], self.w_uv)
        return self.o(values.reshape(-1, self.heads * self.v_dim))
