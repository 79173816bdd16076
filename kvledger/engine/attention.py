"""Attention over block tables: prefill (with or without a cached prefix) and batched decode.

A step's tokens are flattened to ``[T]``: first one token for each decoding sequence (in
*decode groups*), then the new tokens of each prefill chunk, one *segment* per sequence. New K/V
are written to their slots first (``slot_mapping``), then each query attends over its sequence's
context gathered from the blocks:

- decode groups: ``[B, L]`` slot indices (padded to the group's longest context, with a mask),
  one scaled-dot-product attention call per group; decoding sequences are sorted by context
  length and grouped so that padding wastes little gather and attention work;
- prefill segment without a cached prefix: causal attention over its own new K/V (no gather);
- prefill segment after a cached prefix (prefix-cache hit or chunked prefill): gather the
  ``context_len`` slots, mask so the query at position p sees keys at positions <= p.

Without a KV store (``slot_mapping is None``: the no-cache mode of seed §1.3) every segment is a
whole sequence recomputed from position 0. GQA is handled by SDPA's ``enable_gqa``.
Softmax scale 1/sqrt(head_dim) (Vaswani et al., 2017).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvledger.engine.kv.store import KVStore


@dataclass
class DecodeGroup:
    """``num_seqs`` decode tokens (one per sequence) from flat offset ``start``.

    ``slots``: [num_seqs, max_context] int64 slot of each context position (padding repeats a
    valid slot); ``mask``: [num_seqs, 1, 1, max_context] bool (True = attend) or None when all
    contexts have the same length.
    """

    start: int
    num_seqs: int
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class PrefillSegment:
    """``length`` new tokens of one sequence starting at flat offset ``start``.

    ``slots``: [context_len] int64 slots of the whole context (cached prefix + new tokens), or
    None when the segment has no prefix (causal attention over the new K/V alone).
    ``mask``: [length, context_len] bool, set together with ``slots``.
    """

    start: int
    length: int
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once and shared by all layers."""

    slot_mapping: torch.Tensor | None
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)


def paged_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    meta: AttentionMetadata, store: KVStore | None) -> torch.Tensor:
    """Attention output [T, heads, head_dim] for queries q [T, heads, head_dim].

    k, v: [T, kv_heads, head_dim], the new tokens' keys (rotated) and values; they are written
    to the store before attending, so a sequence's own new tokens are part of its context.
    """
    if meta.slot_mapping is not None:
        store.write(layer, meta.slot_mapping, k, v)
    parts = []
    for group in meta.decodes:
        parts.append(_decode(layer, q[group.start: group.start + group.num_seqs], group, store))
    for seg in meta.prefills:
        parts.append(_prefill(layer, q, k, v, seg, store))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _decode(layer: int, q: torch.Tensor, group: DecodeGroup, store: KVStore) -> torch.Tensor:
    keys, values = store.gather(layer, group.slots)  # [B, L, kv_heads, D]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=group.mask, enable_gqa=True)
    return out.squeeze(2)


def _prefill(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             seg: PrefillSegment, store: KVStore | None) -> torch.Tensor:
    span = slice(seg.start, seg.start + seg.length)
    query = q[span].transpose(0, 1).unsqueeze(0)
    if seg.slots is None:
        keys, values = k[span], v[span]
    else:
        keys, values = store.gather(layer, seg.slots)
    out = F.scaled_dot_product_attention(
        query, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
        attn_mask=seg.mask, is_causal=seg.slots is None, enable_gqa=True)
    return out[0].transpose(0, 1)
