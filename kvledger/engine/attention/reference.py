"""Attention backends: the shared step loop and the *reference* backend (gather + SDPA).

Every backend runs the same loop over a step (:class:`AttentionBackend`): write the new tokens'
K/V to their slots, then

- decode groups: one query per sequence over its whole context;
- prefill segment without a cached prefix: causal attention over its own new K/V (no cache
  read; PyTorch's SDPA, the same for every backend);
- prefill segment after a cached prefix (prefix-cache hit or chunked prefill): query at
  position p sees keys at positions <= p.

A prefill query reads the step's own tokens as computed, never read back from a lossy pool
(a quantized format, or a 16-bit one under fp32 compute): the blocks the step wrote come from
the store's ``step_blocks``, every other block from the pool (issue 58; what is written is the
same). Decodes read the pool.

Backends differ in how the first and last read the cache. The reference one gathers each
context's slots into a dense tensor (``index_select``) and calls SDPA: simple, and the oracle the
paged backends are tested against. Decoding sequences are sorted by context length and grouped
by the runner so padding wastes little gather and attention work. Without a KV store
(``slot_mapping is None``: the no-cache mode of seed §1.3) every segment is a whole sequence
recomputed from position 0. GQA via SDPA's ``enable_gqa``. Each layer's score scale, sliding
window and soft-cap come from :meth:`AttentionBackend.set_layers` (:mod:`.layer`; by default
1/sqrt(head_dim), Vaswani et al., 2017): the window narrows the masks here, and a soft-capped
layer or one with sink logits is attended without SDPA (it cannot take the tanh or the extra
logit).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kvledger.engine.attention.layer import LayerAttention
from kvledger.engine.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSegment
from kvledger.engine.kv.store import KVStore, StepBlocks
from kvledger.model.layers.rotary import RotaryEmbedding


class AttentionBackend:
    """One step of attention for one layer; subclasses say how cached K/V are read."""

    name = "abstract"
    layers: tuple[LayerAttention, ...] = ()

    def set_layers(self, layers) -> None:
        """Take the model's per-layer attention parameters (:func:`.layer.layers_of`)."""
        self.layers = tuple(layers)

    def how(self, layer: int, head_dim: int) -> LayerAttention:
        """Layer ``layer``'s parameters; plain 1/sqrt(head_dim) attention when none were set."""
        return self.layers[layer] if self.layers else LayerAttention(head_dim ** -0.5)

    def reader(self, store: KVStore) -> str:
        """Which backend reads ``store``'s KV (the TPOT table names it): this one."""
        return self.name

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata, store: KVStore | None) -> torch.Tensor:
        """Attention output [T, heads, head_dim] for queries q [T, heads, head_dim].

        k, v: [T, kv_heads, head_dim], the new tokens' keys (rotated) and values; they are
        written to the store before attending, so a sequence's new tokens are in its context.
        """
        meta = meta.of_layer(layer)
        step = None
        if meta.slot_mapping is not None:
            store.write(layer, meta.slot_mapping, k, v, meta.seal)
            # prefill queries attend over the step's own tokens as computed (a lossy pool's
            # blocks this step wrote are read from ``step``); decodes read the pool itself
            if any(seg.slots is not None and not seg.gathered for seg in meta.prefills):
                step = store.step_blocks(layer, meta.slot_mapping, k, v)
        parts, how = [], self.how(layer, q.shape[-1])
        for group in meta.decodes:
            span = slice(group.start, group.start + group.num_seqs)
            parts.append(self.decode(layer, q[span], group, store))
        for seg in meta.prefills:
            span = slice(seg.start, seg.start + seg.length)
            if seg.slots is None:
                parts.append(_sdpa(q[span], k[span], v[span], None, causal=True, how=how))
            elif seg.gathered:
                parts.append(gathered_prefill(layer, q[span], seg, store, how))
            else:
                parts.append(self.prefill_after_prefix(layer, q[span], seg, store, step))
        for observer in meta.observers:
            observer.observe(layer, q, store)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def decode(self, layer: int, q: torch.Tensor, group: DecodeGroup,
               store: KVStore) -> torch.Tensor:
        """[num_seqs, heads, head_dim] output of one decode group's queries q (same shape)."""
        raise NotImplementedError

    def prefill_after_prefix(self, layer: int, q: torch.Tensor, seg: PrefillSegment,
                             store: KVStore, step: StepBlocks | None = None) -> torch.Tensor:
        """[length, heads, head_dim] output of a segment's queries over prefix + new tokens;
        the blocks of ``step`` (those the step wrote) read from it, not from the pool."""
        raise NotImplementedError


class ReferenceBackend(AttentionBackend):
    """Gather every context into dense K/V, then PyTorch SDPA."""

    name = "reference"

    def decode(self, layer, q, group, store):
        return gathered_decode(layer, q, group, store, self.how(layer, q.shape[-1]))

    def prefill_after_prefix(self, layer, q, seg, store, step=None):
        how = self.how(layer, q.shape[-1])
        if how.window is not None:  # the segment's positions are its context's last ones
            context = seg.slots.shape[0]
            positions = torch.arange(context, device=seg.slots.device)
            seg = dataclasses.replace(seg, mask=seg.mask & how.visible(
                positions[context - seg.length:], positions))
        return gathered_prefill(layer, q, seg, store, how, step)


def gathered_decode(layer: int, q: torch.Tensor, group: DecodeGroup, store: KVStore,
                    how: LayerAttention | None = None) -> torch.Tensor:
    """[num_seqs, heads, D] output of a decode group's queries over its ``slots`` gathered;
    with a window (``how``), over the last W of a context of block-table slots."""
    keys, values = store.gather(layer, group.slots)  # [B, L, kv_heads, D]
    mask = group.mask
    if how is not None and how.window is not None:
        assert not group.slot_view, "a sliding window over a retained slot list"
        width = group.slots.shape[1]
        on = group.slots.device
        lens = torch.full((group.num_seqs,), width, device=on) if mask is None else mask.reshape(
            group.num_seqs, -1).sum(-1)
        seen = torch.arange(width, device=on)[None, :] >= (lens - how.window)[:, None]
        mask = seen[:, None, None, :] if mask is None else mask & seen[:, None, None, :]
    return _attend(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), mask, False,
                   how).squeeze(2)


def gathered_prefill(layer: int, q: torch.Tensor, seg: PrefillSegment, store: KVStore,
                     how: LayerAttention | None = None,
                     step: StepBlocks | None = None) -> torch.Tensor:
    """[length, heads, D] output of a segment's queries over its ``slots`` gathered, under its
    ``mask`` [length, context] (which holds any window); every query must see at least one
    key. The rows of ``seg.key_turn`` are rotated (RoPE) after the gather, in the gathered
    copy only; slots in the blocks of ``step`` are read from it."""
    keys, values = store.gather(layer, seg.slots)
    if step is not None:
        keys, values = over_step(keys, values, seg.slots, step, store.block_size)
    if seg.key_turn is not None:
        rows, cos, sin = seg.key_turn
        keys[rows] = RotaryEmbedding.apply(keys[rows], cos, sin)
    return _sdpa(q, keys, values, seg.mask, causal=False, how=how)


def over_step(keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, step: StepBlocks,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [L, kv_heads, D] gathered at ``slots`` [L] with the rows in the blocks of
    ``step`` replaced by the step's own (rotated back)."""
    blocks = slots // block_size
    inside = torch.isin(blocks, step.ids)
    if not bool(inside.any()):
        return keys, values
    where = torch.nonzero(inside).flatten()
    rows = torch.searchsorted(step.ids, blocks[where]) * block_size + slots[where] % block_size
    out = []
    for x, fresh in zip((keys, values), step.unrotated()):
        flat = fresh.reshape(-1, *fresh.shape[2:])
        out.append(x.index_copy(0, where, flat.index_select(0, rows).to(x.dtype)))
    return out[0], out[1]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          causal: bool, how: LayerAttention | None = None) -> torch.Tensor:
    """Attention of one sequence: q [n, heads, D], k/v [L, kv_heads, D] -> [n, heads, D];
    ``causal`` (k and v are the n queries' own) narrowed by the window of ``how``."""
    if causal and how is not None and how.window is not None:
        positions = torch.arange(q.shape[0], device=q.device)
        mask = (positions[None, :] <= positions[:, None]) & how.visible(positions, positions)
        causal = False
    out = _attend(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                  v.transpose(0, 1).unsqueeze(0), mask, causal, how)
    return out[0].transpose(0, 1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            causal: bool, how: LayerAttention | None) -> torch.Tensor:
    """Attention over [B, heads, n, D] queries, [B, kv_heads, L, D] keys and values (GQA)
    under ``mask`` (True = attend) or ``causal``: SDPA with the layer's scale, or the scores
    written out when the layer soft-caps them (as transformers' eager Gemma 2 attention) or
    has sink logits (a last column of the softmax, dropped after it, as its eager gpt-oss
    attention)."""
    scale = None if how is None else how.scale
    if how is None or (how.softcap is None and how.sinks is None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if how.softcap is not None:
        scores = torch.tanh(scores / how.softcap) * how.softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, -torch.inf)
    scores = scores.float()
    if how.sinks is not None:
        sinks = how.sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, sinks), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs.to(v.dtype) @ v
