"""Paged backends: attention read straight from the block pool by block table.

Both compute, for each query, softmax(scale x q . K^T) V over the first ``context_len``
positions of its sequence (the last W of them in a sliding layer: the query is at position
``context_len - 1``, :mod:`.layer`), one chunk of blocks at a time with an *online softmax* (a running
maximum m, normaliser l and weighted sum acc per query head, rescaled by exp(m_old - m_new) when
a chunk raises the maximum; Milakov & Gimelshein, arXiv:1805.02867). Queries of a KV head's
group share that head's K/V: q is viewed as [N, kv_heads, group, D], K/V are never repeated.

- :class:`PagedTorchBackend`: the algorithm in PyTorch ops, ``CHUNK_BLOCKS`` blocks per chunk
  (each chunk is an ``index_select`` of whole blocks, so memory stays bounded at any context).
  It needs no compiler and is the fallback when the native kernel cannot be built.
- :class:`PagedNativeBackend`: the same loop in C++ (``paged_attention.cpp``), reading K/V in
  place one block at a time, no copy at all, from the window's first block. Over a quantized
  store (fp8, int8, int4) it reads the codes themselves, the scales folded into the query and
  the probabilities. Soft-capped layers (Gemma 2) and sink logits (gpt-oss) stay on it.

Sink logits (:mod:`.layer`) join the normaliser once, after the last chunk: with the final
maximum ``m* = max(m, sink)``, ``out = acc e^(m - m*) / (l e^(m - m*) + e^(sink - m*))``.

Seam for the next issues: a chunk's K/V come from :meth:`read_blocks` (a quantized KV format
dequantises there, per block).
"""

from __future__ import annotations

import logging
import math

import torch

from kvledger.engine.attention.metadata import PagedQueries
from kvledger.engine.attention.reference import AttentionBackend, gathered_decode
from kvledger.engine.kv.codec_numbers import codec_numbers
from kvledger.engine.kv.store import KVStore, StepBlocks

CHUNK_BLOCKS = 32
log = logging.getLogger("kvledger.engine")


class _Paged(AttentionBackend):
    def decode(self, layer, q, group, store):
        if group.slot_view:
            return self.attend_slots(layer, q, group, store)
        return self.attend(layer, q, group.paged(store.block_size), store)

    def attend_slots(self, layer: int, q: torch.Tensor, group, store: KVStore) -> torch.Tensor:
        """Output [num_seqs, heads, D] of a decode group whose contexts are any slot lists
        (``DecodeGroup.slot_view``); here by gather + SDPA, as the reference backend."""
        return gathered_decode(layer, q, group, store, self.how(layer, q.shape[-1]))

    def prefill_after_prefix(self, layer, q, seg, store, step=None):
        return self.attend(layer, q, seg.paged(store.block_size), store, step)

    def attend(self, layer: int, q: torch.Tensor, paged: PagedQueries, store: KVStore,
               step: StepBlocks | None = None) -> torch.Tensor:
        """Output [N, heads, D] of queries q [N, heads, D] described by ``paged``; the blocks
        of ``step`` read from it instead of the pool."""
        raise NotImplementedError


def read_blocks(store: KVStore, layer: int, block_ids: torch.Tensor,
                step: StepBlocks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of blocks ``block_ids`` (any shape S) -> S + [block_size, kv_heads, D] each;
    a quantized store dequantises these blocks only (one chunk of the loop); the blocks of
    ``step`` come from it."""
    keys, values = store.read_blocks(layer, block_ids)
    if step is None:
        return keys, values
    flat = block_ids.reshape(-1)
    where = torch.nonzero(torch.isin(flat, step.ids)).flatten()
    if not len(where):
        return keys, values
    rows = torch.searchsorted(step.ids, flat.index_select(0, where))
    out = []
    for x, fresh in zip((keys, values), step.unrotated()):
        x = x.reshape(-1, *x.shape[-3:]).to(fresh.dtype).index_copy(
            0, where, fresh.index_select(0, rows))
        out.append(x.view(*block_ids.shape, *x.shape[1:]))
    return out[0], out[1]


class PagedTorchBackend(_Paged):
    """Block-chunked online softmax in PyTorch ops (the fallback of the native kernel)."""

    name = "paged-torch"

    def attend(self, layer, q, paged, store, step=None):
        n, heads, dim = q.shape
        bs = store.block_size
        kv_heads = store.num_kv_heads
        how = self.how(layer, dim)
        qg = q.reshape(n, kv_heads, heads // kv_heads, dim).float() * how.scale
        tables = paged.block_tables.long()
        shared = tables.shape[0] == 1  # one sequence's segment: read its blocks once
        if not shared:
            tables = tables.index_select(0, paged.seq_of_query.long())
        lens = paged.context_lens.long()
        starts = (lens - how.window).clamp(min=0) if how.window else torch.zeros_like(lens)
        used_blocks = -(-int(lens.max()) // bs)
        m = torch.full((n, kv_heads, heads // kv_heads, 1), -math.inf, device=q.device)
        l_sum = torch.zeros_like(m)
        acc = torch.zeros(n, kv_heads, heads // kv_heads, dim, device=q.device)
        for first in range(int(starts.min()) // bs, used_blocks, CHUNK_BLOCKS):
            ids = tables[:, first: min(first + CHUNK_BLOCKS, used_blocks)]
            keys, values = read_blocks(store, layer, ids, step)  # [S, C, bs, kv_heads, D]
            s_rows = keys.shape[0]
            keys = keys.reshape(s_rows, -1, kv_heads, dim).permute(0, 2, 3, 1).float()
            values = values.reshape(s_rows, -1, kv_heads, dim).transpose(1, 2).float()
            scores = qg @ keys  # [N, kv_heads, G, C * bs]
            if how.softcap is not None:
                scores = torch.tanh(scores / how.softcap) * how.softcap
            pos = torch.arange(first * bs, first * bs + scores.shape[-1], device=q.device)
            hidden = (pos[None, :] >= lens[:, None]) | (pos[None, :] < starts[:, None])
            scores = scores.masked_fill(hidden[:, None, None, :], -math.inf)
            m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # no key seen yet
            corr = torch.exp(m - m_safe)
            p = torch.exp(scores - m_safe)
            l_sum = l_sum * corr + p.sum(-1, keepdim=True)
            acc = acc * corr + p @ values
            m = m_new
        if how.sinks is not None:  # [heads] -> [1, kv_heads, G, 1], the last term of l
            sinks = how.sinks.float().reshape(1, kv_heads, heads // kv_heads, 1)
            m_all = torch.maximum(m, sinks)
            corr = torch.exp(m - m_all)
            acc, l_sum = acc * corr, l_sum * corr + torch.exp(sinks - m_all)
        return (acc / l_sum).reshape(n, heads, dim).to(q.dtype)


class PagedNativeBackend(_Paged):
    """The device's paged-attention kernel (``Kernels.paged_attention``); falls back to
    :class:`PagedTorchBackend` for shapes it does not take."""

    name = "paged-native"

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._fallback = PagedTorchBackend()
        self._sides_of: tuple[object, dict] | None = None  # (store, layer -> kernel's view)

    def set_layers(self, layers) -> None:
        super().set_layers(layers)
        self._fallback.set_layers(layers)

    def attend(self, layer, q, paged, store, step=None):
        how = self.how(layer, q.shape[-1])
        if step is not None and not (store.quantized and self.kernel.reads_step_blocks):
            return self._fallback.attend(layer, q, paged, store, step)
        if store.quantized:
            sides = self._sides(store, layer) if self.kernel.accepts_quantized(q, store) else None
            if sides is None:
                return self._fallback.attend(layer, q, paged, store, step)
            args = (q, sides[0], store.residual_of, store.block_size, store.num_kv_heads,
                    paged, how.scale, how.window, how.sinks)
            return (self.kernel.quantized(*args, softcap=how.softcap) if step is None
                    else self.kernel.quantized(*args, step=step, softcap=how.softcap))
        keys, values = store.key_blocks[layer], store.value_blocks[layer]
        if not self.kernel.accepts(q, keys):
            return self._fallback.attend(layer, q, paged, store)
        return self.kernel(q, keys, values, paged, how.scale, how.window, how.sinks,
                           softcap=how.softcap)

    def attend_slots(self, layer, q, group, store):
        """The kernel over the pool viewed as blocks of one slot ([blocks * bs, 1, kv_heads,
        D], no copy): a token-granular block table, read in place."""
        keys, values = store.key_blocks[layer], store.value_blocks[layer]
        how = self.how(layer, q.shape[-1])
        if store.quantized or not self.kernel.accepts(q, keys) or how.window:
            return super().attend_slots(layer, q, group, store)
        one = (-1, 1, *keys.shape[2:])
        return self.kernel(q, keys.view(one), values.view(one), group.paged(1), how.scale,
                           sinks=how.sinks, softcap=how.softcap)

    def reader(self, store):
        """This kernel, or ``paged-torch`` for the layers it hands over (a quantized format
        it has no decoder for), e.g. 'paged-native (paged-torch: 2 of 30 layers)'."""
        layers = store.key_parts if store.quantized else store.key_blocks
        over = sum(store.quantized and self._sides(store, i) is None
                   for i in range(len(layers)))
        if not over:
            return self.name
        return f"{self.name} (paged-torch: {over} of {len(layers)} layers)"

    def _sides(self, store, layer: int):
        """((K side, V side), tensors held) of ``layer`` of a quantized store, built once per
        store and layer (its tensors never move); None when a codec has no kernel decoder."""
        if self._sides_of is None or self._sides_of[0] is not store:
            self._sides_of = (store, {})
        cache = self._sides_of[1]
        if layer not in cache:
            k = self._side(store.key_parts[layer], store.key_codecs[layer],
                           store.residual_keys[layer], store.rotation, store.group_members)
            v = self._side(store.value_parts[layer], store.value_codec,
                           store.residual_values[layer], store.rotation)
            usable = (k is not None and v is not None and k[0].kind == v[0].kind
                      and v[0].num_outliers == 0)  # one codec kind; outliers are keys' only
            cache[layer] = ((k[0], v[0]), k[1] + v[1]) if usable else None
            if cache[layer] is None:
                log.info("paged-native has no decoder for %s KV; paged-torch attends over it",
                         store.kv_format)
        return cache[layer]

    def _side(self, parts, codec, residual, rotation, group_members=None):
        """The kernel's view of one codec's tensors (``kv_side`` of the kernel), or None for
        a codec it has no decoder for (grouped keys without their group's blocks)."""
        numbers = codec_numbers(codec)
        if numbers is None or (numbers.grouped and group_members is None):
            return None
        return self.kernel.kv_side(parts, residual, kind=numbers.kind, bits=numbers.bits,
                                   group=numbers.group, group_blocks=numbers.group_blocks,
                                   channels=numbers.channels, rotation=rotation,
                                   group_members=group_members)
