"""Per-layer attention parameters (score scale, sliding window, soft-cap, sink logits) in every
backend.

Oracle: the attention written out in float64 in this file over the K/V the store returns
for each context (``store.gather``: the codecs' own decode for a quantized pool): scores
``scale x q . k``, soft-capped ``c tanh(s / c)``, the query at position i seeing the keys
j <= i with ``i - j < W`` (transformers' ``sliding_window_overlay``), softmax (with a head's
sink logit as one more column, dropped after it, as transformers' eager gpt-oss attention),
weighted sum.
Windows around the block size (1, 15, 16, 17, 40) and contexts shorter and longer than them.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvledger.device import resolve
from kvledger.engine.attention import AttentionMetadata, PrefillSegment, make_backend
from kvledger.engine.attention.layer import LayerAttention
from kvledger.engine.kv.codecs import make_codecs
from kvledger.engine.kv.quantized_store import QuantizedKVStore
from kvledger.engine.kv.store import KVStore
from kvledger.engine.runner import _decode_group, _prefix_causal_mask

KERNELS = resolve("cpu").kernels

BLOCK = 16
BACKENDS = ["reference", "paged-torch", "paged-native"]
SINKS = torch.tensor([0.5, -1.0, 2.0, 9.0, -30.0, 1.5, 0.0, 3.0, -2.0])
"""Sink logits of up to 9 query heads: some above every score (9), some negligible (-30)."""
LAYERS = {
    "window 1": LayerAttention(0.1, window=1),
    "window 15": LayerAttention(0.125, window=15),
    "window 16": LayerAttention(0.125, window=16),
    "window 17, scale 1/12": LayerAttention(1 / 12, window=17),
    "window 40 + soft-cap 5": LayerAttention(0.125, window=40, softcap=5.0),
    "soft-cap 2, no window": LayerAttention(0.2, softcap=2.0),
    "scale only": LayerAttention(0.3),
    "sinks, window 17": LayerAttention(0.125, window=17, sinks=SINKS),
    "sinks, no window": LayerAttention(0.2, sinks=SINKS),
}


def _oracle(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query_pos: list[int],
            how: LayerAttention) -> torch.Tensor:
    """[n, heads, D] for queries q [n, heads, D] at ``query_pos`` over keys / values
    [L, kv_heads, D] at positions 0..L-1, in float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, i in enumerate(query_pos):
        lo = 0 if how.window is None else max(0, i - how.window + 1)
        s = torch.einsum("hd,jhd->hj", q[row].double(), k[lo: i + 1]) * how.scale
        if how.softcap is not None:
            s = how.softcap * torch.tanh(s / how.softcap)
        if how.sinks is not None:
            p = torch.softmax(torch.cat((s, how.sinks.double()[:, None]), -1), -1)[:, :-1]
        else:
            p = torch.softmax(s, -1)
        out[row] = torch.einsum("hj,jhd->hd", p, v[lo: i + 1])
    return out


def _fit(how: LayerAttention, heads: int) -> LayerAttention:
    """``how`` with its sink logits cut to ``heads`` query heads."""
    return how if how.sinks is None else dataclasses.replace(how, sinks=how.sinks[:heads])


def _plain_store(kv_heads, dim, num_blocks=48, seed=0):
    store = KVStore(1, num_blocks, BLOCK, kv_heads, dim, torch.float32)
    g = torch.Generator().manual_seed(seed)
    store.key_blocks[0].copy_(torch.randn(store.key_blocks[0].shape, generator=g))
    store.value_blocks[0].copy_(torch.randn(store.value_blocks[0].shape, generator=g))
    return store


def _int8_store(kv_heads, dim, tables, lengths, num_blocks=48):
    """An int8 pool (keys per channel) holding random K/V for the sequences, written in one
    step: full blocks quantized, each partial last block in its residual buffer."""
    keys, values = make_codecs("int8", BLOCK, kv_heads, dim, 32, "per-channel", None)
    store = QuantizedKVStore(1, num_blocks, BLOCK, kv_heads, dim, "int8", keys, values,
                             torch.float32, residual_slots=len(lengths))
    slots = torch.cat([_slots(t, n) for t, n in zip(tables, lengths)])
    g = torch.Generator().manual_seed(1)
    store.write(0, slots, torch.randn(len(slots), kv_heads, dim, generator=g),
                torch.randn(len(slots), kv_heads, dim, generator=g))
    return store


def _slots(table, length):
    return (torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:length]


def _tables(lengths, num_blocks=48, seed=0):
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    out, used = [], 0
    for n in lengths:
        out.append(ids[used: used + -(-n // BLOCK)])
        used += len(out[-1])
    return out


def _backend(name, how):
    backend = make_backend(name, KERNELS)
    backend.set_layers([how])
    return backend


def _call(backend, q, meta, store):
    empty = torch.empty(0, store.num_kv_heads, q.shape[-1])
    return backend(0, q, empty, empty, meta, store)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label", sorted(LAYERS))
def test_decode_groups_respect_the_layer(backend, label, quantized):
    how = _fit(LAYERS[label], 6)
    lengths = [1, 15, 16, 17, 33, 100]
    tables = _tables(lengths)
    store = (_int8_store(2, 64, tables, lengths) if quantized else _plain_store(2, 64))
    q = torch.randn(len(lengths), 6, 64, generator=torch.Generator().manual_seed(2))
    group = _decode_group(0, [_slots(t, n) for t, n in zip(tables, lengths)])
    got = _call(_backend(backend, how), q, AttentionMetadata(None, decodes=[group]), store)
    for row, (table, n) in enumerate(zip(tables, lengths)):
        keys, values = store.gather(0, _slots(table, n))
        want = _oracle(q[row: row + 1], keys, values, [n - 1], how)
        assert float((got[row: row + 1].double() - want).abs().max()) <= 1e-5, (row, n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label", sorted(LAYERS))
@pytest.mark.parametrize("prefix,new", [(1, 1), (15, 2), (40, 33)])
def test_prefill_after_a_prefix_respects_the_layer(backend, label, prefix, new):
    how = _fit(LAYERS[label], 4)
    store = _plain_store(2, 64)
    table = _tables([prefix + new])[0]
    seg = PrefillSegment(0, new, _slots(table, prefix + new), _prefix_causal_mask(prefix, new))
    q = torch.randn(new, 4, 64, generator=torch.Generator().manual_seed(prefix))
    got = _call(_backend(backend, how), q, AttentionMetadata(None, prefills=[seg]), store)
    keys, values = store.gather(0, _slots(table, prefix + new))
    want = _oracle(q, keys, values, list(range(prefix, prefix + new)), how)
    assert float((got.double() - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label", sorted(LAYERS))
def test_prefill_from_position_zero_respects_the_layer(backend, label):
    """A segment with no cached prefix attends over its own new K/V (written first)."""
    how = _fit(LAYERS[label], 4)
    n, store = 50, _plain_store(2, 64)
    slots = _slots(_tables([n])[0], n)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, h, 64, generator=g) for h in (4, 2, 2))
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillSegment(0, n)])
    got = _backend(backend, how)(0, q, k, v, meta, store)
    want = _oracle(q, k, v, list(range(n)), how)
    assert float((got.double() - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["", "sinks"])
def test_native_split_context_respects_the_window(monkeypatch, sinks):
    """A batch-1 decode cut into parts across threads: parts before the window hold no
    position and are skipped in the merge (which adds the sink logits once)."""
    from kvledger.device.cpu.native import PagedKernel

    monkeypatch.setattr(PagedKernel, "THREAD_WORK", 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for window in (5, 16, 70):
            how = LayerAttention(1 / math.sqrt(64), window=window, sinks=sinks)
            lengths = [BLOCK * 20 + 3]
            tables, store = _tables(lengths), _plain_store(3, 64)
            q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(window))
            group = _decode_group(0, [_slots(tables[0], lengths[0])])
            got = _call(_backend("paged-native", how), q,
                        AttentionMetadata(None, decodes=[group]), store)
            keys, values = store.gather(0, _slots(tables[0], lengths[0]))
            want = _oracle(q, keys, values, [lengths[0] - 1], how)
            assert float((got.double() - want).abs().max()) <= 1e-5, window
    finally:
        torch.set_num_threads(previous)


def _kernel_only(how: LayerAttention):
    """paged-native with its paged-torch fallback removed: a layer it handed over fails."""
    backend = _backend("paged-native", how)
    assert backend.name == "paged-native"
    backend._fallback = None
    return backend


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("dim", [64, 96], ids=["pair-order", "generic"])
@pytest.mark.parametrize("label", ["soft-cap 2, no window", "window 40 + soft-cap 5"])
def test_native_kernel_takes_soft_capped_layers(label, dim, quantized):
    """Gemma 2's soft-capped layers are attended by the kernel itself (decodes and a prefill
    after a prefix), on its pair-order path (head_dim 64), its generic one (96) and over int8
    blocks, against the float64 oracle; before, the kernel had no tanh and these layers went
    to paged-torch (here: no fallback, so they failed)."""
    how = _fit(LAYERS[label], 6)
    lengths = [1, 15, 16, 17, 33, 100]
    tables = _tables(lengths)
    store = _int8_store(2, dim, tables, lengths) if quantized else _plain_store(2, dim)
    q = torch.randn(len(lengths), 6, dim, generator=torch.Generator().manual_seed(5))
    group = _decode_group(0, [_slots(t, n) for t, n in zip(tables, lengths)])
    got = _call(_kernel_only(how), q, AttentionMetadata(None, decodes=[group]), store)
    for row, (table, n) in enumerate(zip(tables, lengths)):
        keys, values = store.gather(0, _slots(table, n))
        want = _oracle(q[row: row + 1], keys, values, [n - 1], how)
        assert float((got[row: row + 1].double() - want).abs().max()) <= 1e-5, (row, n)
    if not quantized:
        table = _tables([73])[0]
        seg = PrefillSegment(0, 33, _slots(table, 73), _prefix_causal_mask(40, 33))
        q = torch.randn(33, 6, dim, generator=torch.Generator().manual_seed(6))
        got = _call(_kernel_only(how), q, AttentionMetadata(None, prefills=[seg]), store)
        keys, values = store.gather(0, _slots(table, 73))
        want = _oracle(q, keys, values, list(range(40, 73)), how)
        assert float((got.double() - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("sinks", [None, SINKS], ids=["", "sinks"])
def test_native_split_context_soft_caps_each_part(monkeypatch, sinks):
    """A batch-1 decode cut into parts across threads with a soft-cap (and sink logits): each
    part caps its own scores before its running max, the merge adds the sinks once."""
    from kvledger.device.cpu.native import PagedKernel

    monkeypatch.setattr(PagedKernel, "THREAD_WORK", 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        how = LayerAttention(0.5, window=70, softcap=3.0, sinks=sinks)
        lengths = [BLOCK * 20 + 3]
        tables, store = _tables(lengths), _plain_store(3, 64)
        q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(7))
        group = _decode_group(0, [_slots(tables[0], lengths[0])])
        got = _call(_kernel_only(how), q, AttentionMetadata(None, decodes=[group]), store)
        keys, values = store.gather(0, _slots(tables[0], lengths[0]))
        want = _oracle(q, keys, values, [lengths[0] - 1], how)
        assert float((got.double() - want).abs().max()) <= 1e-5
    finally:
        torch.set_num_threads(previous)
