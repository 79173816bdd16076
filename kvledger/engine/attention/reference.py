"""Attention backends: the shared step loop and the *reference* backend (gather + SDPA).

Every backend runs the same loop over a step (:class:`AttentionBackend`): write the new tokens'
K/V to their slots, then

- decode groups: one query per sequence over its whole context;
- prefill segment without a cached prefix: causal attention over its own new K/V (no cache
  read; PyTorch's SDPA, the same for every backend);
- prefill segment after a cached prefix (prefix-cache hit or chunked prefill): query at
  position p sees keys at positions <= p.

Backends differ in how the first and last read the cache. The reference one gathers each
context's slots into a dense tensor (``index_select``) and calls SDPA: simple, and the oracle the
paged backends are tested against. Decoding sequences are sorted by context length and grouped
by the runner so padding wastes little gather and attention work. Without a KV store
(``slot_mapping is None``: the no-cache mode of seed §1.3) every segment is a whole sequence
recomputed from position 0. GQA via SDPA's ``enable_gqa``; softmax scale 1/sqrt(head_dim)
(Vaswani et al., 2017).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvledger.engine.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment
from kvledger.engine.kv.store import KVStore
from kvledger.model.rope import RotaryEmbedding


class AttentionBackend:
    """One step of attention for one layer; subclasses say how cached K/V are read."""

    name = "abstract"

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata, store: KVStore | None) -> torch.Tensor:
        """Attention output [T, heads, head_dim] for queries q [T, heads, head_dim].

        k, v: [T, kv_heads, head_dim], the new tokens' keys (rotated) and values; they are
        written to the store before attending, so a sequence's new tokens are in its context.
        """
        if meta.slot_mapping is not None:
            store.write(layer, meta.slot_mapping, k, v)
            # a prefill without a prefix attends over the step's own k, v: over what the cache
            # holds, as a later hit will (decodes and prefixed segments read the store itself)
            if store.lossy and any(seg.slots is None for seg in meta.prefills):
                k, v = store.gather(layer, meta.slot_mapping)
        parts = []
        for group in meta.decodes:
            span = slice(group.start, group.start + group.num_seqs)
            parts.append(self.decode(layer, q[span], group, store))
        for seg in meta.prefills:
            span = slice(seg.start, seg.start + seg.length)
            if seg.slots is None:
                parts.append(_sdpa(q[span], k[span], v[span], None, causal=True))
            elif seg.gathered:
                parts.append(gathered_prefill(layer, q[span], seg, store))
            else:
                parts.append(self.prefill_after_prefix(layer, q[span], seg, store))
        for observer in meta.observers:
            observer.observe(layer, q, store)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def decode(self, layer: int, q: torch.Tensor, group: DecodeGroup,
               store: KVStore) -> torch.Tensor:
        """[num_seqs, heads, head_dim] output of one decode group's queries q (same shape)."""
        raise NotImplementedError

    def prefill_after_prefix(self, layer: int, q: torch.Tensor, seg: PrefillSegment,
                             store: KVStore) -> torch.Tensor:
        """[length, heads, head_dim] output of a segment's queries over prefix + new tokens."""
        raise NotImplementedError


class ReferenceBackend(AttentionBackend):
    """Gather every context into dense K/V, then PyTorch SDPA."""

    name = "reference"

    def decode(self, layer, q, group, store):
        return gathered_decode(layer, q, group, store)

    def prefill_after_prefix(self, layer, q, seg, store):
        return gathered_prefill(layer, q, seg, store)


def gathered_decode(layer: int, q: torch.Tensor, group: DecodeGroup,
                    store: KVStore) -> torch.Tensor:
    """[num_seqs, heads, D] output of a decode group's queries over its ``slots`` gathered."""
    keys, values = store.gather(layer, group.slots)  # [B, L, kv_heads, D]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=group.mask, enable_gqa=True)
    return out.squeeze(2)


def gathered_prefill(layer: int, q: torch.Tensor, seg: PrefillSegment,
                     store: KVStore) -> torch.Tensor:
    """[length, heads, D] output of a segment's queries over its ``slots`` gathered, under its
    ``mask`` [length, context]; every query must see at least one key. The rows of
    ``seg.key_turn`` are rotated (RoPE) after the gather, in the gathered copy only."""
    keys, values = store.gather(layer, seg.slots)
    if seg.key_turn is not None:
        rows, cos, sin = seg.key_turn
        keys[rows] = RotaryEmbedding.apply(keys[rows], cos, sin)
    return _sdpa(q, keys, values, seg.mask, causal=False)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          causal: bool) -> torch.Tensor:
    """SDPA of one sequence: q [n, heads, D], k/v [L, kv_heads, D] -> [n, heads, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=causal, enable_gqa=True)
    return out[0].transpose(0, 1)
