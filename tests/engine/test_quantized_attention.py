"""The native kernel reads quantized blocks (fp8, int8, int4, fp16 outliers, the residual
partial block) and gives paged-torch's output over the same pool.

Oracle: attention in float64 over the K/V that the store's ``read_blocks`` returns (the
codecs' own ``decode``, tested against the formats' bounds in tests/engine/kv/test_codecs.py,
and the residual buffers). In fp32 the kernel stays within 1e-5 of it (~5e-6 measured here at
600 positions with a x20 key channel) and paged-torch, the fallback, within 4e-5 (its fp32
sums land up to 1.5e-5 away). The native backend's fallback is removed, so a configuration the kernel refused would
fail here instead of passing through paged-torch.
"""

from __future__ import annotations

import pytest
import torch

from kvledger.device import resolve
from kvledger.device.cpu.native import PagedKernel
from kvledger.engine.attention import AttentionMetadata, PrefillSegment, make_backend
from kvledger.engine.kv.codecs import make_codecs
from kvledger.engine.kv.quantized_store import QuantizedKVStore
from kvledger.engine.runner import _decode_group, _prefix_causal_mask

KERNELS = resolve("cpu").kernels

BLOCK = 16
CODECS = {  # label -> (format, key quant, group, outlier channels per KV head)
    "int8": ("int8", "per-channel", 32, 0),
    "int8 per-token keys g8": ("int8", "per-token", 8, 0),
    "int4": ("int4", "per-channel", 32, 0),
    "int4 per-token keys g16": ("int4", "per-token", 16, 0),
    "int4 per-token keys g4": ("int4", "per-token", 4, 0),  # groups inside a kernel vector
    "int4 + 3 outliers": ("int4", "per-channel", 32, 3),
    "int8 per-token keys + 2 outliers": ("int8", "per-token", 64, 2),
    "fp8": ("fp8", "per-channel", 32, 0),
    "fp8 + 2 outliers": ("fp8", "per-channel", 32, 2),
}


def _store(label, kv_heads, dim, tables, lengths, dtype=torch.float32, num_blocks=64, seed=0,
           codec=None, shape_keys=None):
    """A one-layer quantized pool holding random K/V (keys with a x20 channel, or as
    ``shape_keys`` reshapes them) for sequences ``tables`` of ``lengths`` tokens, written in one
    step: full blocks are quantized, each sequence's partial last block stays in its residual
    buffer. ``codec`` (format, key quant, group, outliers) instead of a ``label`` of CODECS."""
    fmt, key_quant, group, n_out = codec or CODECS[label]
    g = torch.Generator().manual_seed(seed)
    channels = None
    if n_out:
        channels = torch.stack([torch.randperm(dim, generator=g)[:n_out]
                                for _ in range(kv_heads)])[None]
    keys, values = make_codecs(fmt, BLOCK, kv_heads, dim, group, key_quant, channels)
    store = QuantizedKVStore(1, num_blocks, BLOCK, kv_heads, dim, fmt, keys, values, dtype,
                             residual_slots=len(lengths))
    slots = torch.cat([(torch.tensor(t)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:n]
                       for t, n in zip(tables, lengths)])
    k = torch.randn(len(slots), kv_heads, dim, generator=g)
    k[:, :, 5] *= 20.0
    if shape_keys is not None:
        shape_keys(k)
    v = torch.randn(len(slots), kv_heads, dim, generator=g)
    store.write(0, slots, k.to(dtype), v.to(dtype))
    return store


def _tables(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(64, generator=g).tolist()
    tables, used = [], 0
    for n in lengths:
        blocks = -(-n // BLOCK)
        tables.append(ids[used: used + blocks])
        used += blocks
    return tables


def _decode_meta(tables, lengths):
    contexts = [(torch.tensor(t)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:n]
                for t, n in zip(tables, lengths)]
    return AttentionMetadata(slot_mapping=None, decodes=[_decode_group(0, contexts)])


def _native():
    backend = make_backend("paged-native", KERNELS)
    assert backend.name == "paged-native"
    backend._fallback = None  # no silent hand-over to paged-torch
    return backend


def _exact(q, store, tables, lens):
    """float64 attention of query i over the first lens[i] positions of blocks tables[i]."""
    heads, dim = q.shape[1:]
    kv_heads = store.num_kv_heads
    out = []
    for qi, table, n in zip(q.double(), tables, lens):
        k, v = store.read_blocks(0, torch.tensor(table))
        k = k.reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        v = v.reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        p = (torch.einsum("hd,nhd->hn", qi, k) / dim ** 0.5).softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


def _check(q, meta_fn, store, tables, lens, tol=1e-5, torch_tol=None):
    """paged-native within ``tol`` of the float64 oracle, paged-torch within ``torch_tol``
    (default 4 x ``tol``)."""
    empty = torch.empty(0, store.num_kv_heads, q.shape[-1], dtype=q.dtype)
    want = _exact(q, store, tables, lens)
    for backend, bound in ((_native(), tol),
                           (make_backend("paged-torch", KERNELS), torch_tol or 4 * tol)):
        got = backend(0, q, empty, empty, meta_fn(), store)
        assert got.dtype == q.dtype and got.shape == q.shape
        assert float((got.double() - want).abs().max()) <= bound, backend.name


@pytest.mark.parametrize("label", sorted(CODECS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])
def test_native_decode_over_quantized_blocks_equals_paged_torch(label, heads, kv_heads):
    lengths = [37, 5, 160, BLOCK, 2 * BLOCK + 1, BLOCK * 37 + 3]  # partial and full last blocks
    tables = _tables(lengths, seed=heads)
    store = _store(label, kv_heads, 64, tables, lengths)
    assert int((store.residual_of >= 0).sum()) == 4  # the partial last blocks
    q = torch.randn(len(lengths), heads, 64, generator=torch.Generator().manual_seed(3))
    _check(q, lambda: _decode_meta(tables, lengths), store, tables, lengths)


@pytest.mark.parametrize("label", ["int8", "int4 + 3 outliers", "fp8"])
@pytest.mark.parametrize("prefix,new", [(16, 9), (47, 50), (1, 1)])
def test_native_prefill_after_prefix_over_quantized_blocks(label, prefix, new):
    table = [12, 3, 25, 8, 0, 19, 6]
    store = _store(label, 3, 64, [table], [prefix + new])
    seg = lambda: AttentionMetadata(None, prefills=[PrefillSegment(
        0, new, (torch.tensor(table)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
        [:prefix + new], _prefix_causal_mask(prefix, new))])
    q = torch.randn(new, 9, 64, generator=torch.Generator().manual_seed(prefix))
    _check(q, seg, store, [table] * new, range(prefix + 1, prefix + new + 1))


@pytest.mark.parametrize("label", ["int8", "int4", "fp8"])
def test_native_split_context_over_quantized_blocks(monkeypatch, label):
    """Batch-1 decode cut into parts across threads, merged: the same output."""
    monkeypatch.setattr(PagedKernel, "THREAD_WORK", 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lengths = [BLOCK * 30 + 7]
        tables = _tables(lengths, seed=1)
        store = _store(label, 3, 64, tables, lengths)
        q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(2))
        _check(q, lambda: _decode_meta(tables, lengths), store, tables, lengths)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_native_folded_scales_keep_a_large_channel_and_a_constant_one(fmt):
    """The kernel folds per-channel key scales and zero points into the query (q.k = (q s).code
    + q.z): a key channel near 600 (zero point ~600, a small scale), a constant channel (the
    smallest scale, every code 0) and an all-zero one give the oracle's output. Terms of the
    scores reach ~75, so fp32 sums are ~1e-5 off: native <= 2e-5 (measured 5-8e-6 for the
    three formats), paged-torch, which decodes then attends in fp32, <= 1e-4 (measured 3.5e-5)."""
    def shape(k):
        k[:, :, 5] = 600.0 + k[:, :, 5] / 20.0  # |x| ~ 600 over a range of a few units
        k[:, :, 7] = -3.25
        k[:, :, 11] = 0.0

    lengths = [70, BLOCK * 12, 21]
    tables = _tables(lengths, seed=5)
    store = _store(None, 3, 64, tables, lengths, codec=(fmt, "per-channel", 32, 0),
                   shape_keys=shape)
    q = torch.randn(len(lengths), 9, 64, generator=torch.Generator().manual_seed(4))
    _check(q, lambda: _decode_meta(tables, lengths), store, tables, lengths, tol=2e-5,
           torch_tol=1e-4)


@pytest.mark.parametrize("key_quant", ["per-token", "per-channel"])
def test_native_head_dim_96_groups_of_12(key_quant):
    """head_dim 96 (no unrolled kernel for it) with groups of 12: value groups, and per-token
    key groups, that straddle the kernel's 8-lane vectors; plus 2 outlier channels."""
    lengths = [45, BLOCK * 5, 7]
    tables = _tables(lengths, seed=6)
    store = _store(None, 3, 96, tables, lengths, codec=("int4", key_quant, 12, 2))
    q = torch.randn(len(lengths), 9, 96, generator=torch.Generator().manual_seed(5))
    _check(q, lambda: _decode_meta(tables, lengths), store, tables, lengths)


@pytest.mark.parametrize("label", ["int8", "int4 + 3 outliers", "fp8"])
def test_native_bf16_compute_over_quantized_blocks(label):
    """bf16 compute: the kernel attends over the fp32 dequantized values, the oracle over
    decode(bf16), which rounds them to bf16; outputs within two bf16 ulps (at |x| < 1)."""
    lengths = [70, 3, 33, 200]
    tables = _tables(lengths, seed=7)
    store = _store(label, 3, 128, tables, lengths, dtype=torch.bfloat16)
    q = torch.randn(len(lengths), 9, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    _check(q, lambda: _decode_meta(tables, lengths), store, tables, lengths, tol=1.6e-2)


def test_native_reads_quantized_blocks_not_a_full_precision_copy(monkeypatch):
    """Decode through paged-native never calls the store's dequantizing read (which is how
    paged-torch and the reference backend materialise K/V)."""
    lengths = [100, 20]
    tables = _tables(lengths, seed=2)
    store = _store("int4", 3, 64, tables, lengths)

    def refuse(*_):
        raise AssertionError("read_blocks called")

    monkeypatch.setattr(store, "read_blocks", refuse)
    q = torch.randn(2, 9, 64)
    empty = torch.empty(0, 3, 64)
    out = _native()(0, q, empty, empty, _decode_meta(tables, lengths), store)
    assert out.shape == q.shape and bool(torch.isfinite(out).all())


@pytest.mark.parametrize("label", ["int8", "int4 + 3 outliers", "fp8"])
def test_a_decode_step_writes_its_token_and_reads_nothing_back(monkeypatch, label):
    """A whole decode step (write the new token, then attend) over a quantized store: the
    token goes to its sequence's residual buffer, no dequantizing read of the step's K/V (a
    decode attends over the store, not over a read-back copy), output = the oracle's over the
    context that now holds the token."""
    lengths = [37, 16, 90]  # the new token: mid-block, opening a block, mid-block
    tables = _tables([n + 1 for n in lengths], seed=5)
    store = _store(label, 3, 64, tables, lengths)
    g = torch.Generator().manual_seed(6)
    new_k, new_v = torch.randn(3, 3, 64, generator=g), torch.randn(3, 3, 64, generator=g)
    q = torch.randn(3, 9, 64, generator=g)
    meta = _decode_meta(tables, [n + 1 for n in lengths])
    meta.slot_mapping = torch.tensor([t[n // BLOCK] * BLOCK + n % BLOCK
                                      for t, n in zip(tables, lengths)])
    def refuse(*_):
        raise AssertionError("the step's K/V were read back from the store")

    monkeypatch.setattr(store, "gather", refuse)
    monkeypatch.setattr(store, "read_blocks", refuse)
    out = _native()(0, q, new_k, new_v, meta, store)
    monkeypatch.undo()
    k, _ = store.read_blocks(0, torch.tensor([t[n // BLOCK] for t, n in zip(tables, lengths)]))
    assert torch.equal(k[torch.arange(3), torch.tensor(lengths) % BLOCK], new_k)
    want = _exact(q, store, tables, [n + 1 for n in lengths])
    assert float((out.double() - want).abs().max()) <= 1e-5
