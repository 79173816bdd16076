"""Residual (full-precision partial) blocks of the quantized pool: one buffer per running
sequence is enough, also in the step where a chunk fills a sequence's partial block and opens
its next one (the buffer of the block that fills is free again before the new one is taken)."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.kv.codecs import make_codecs
from kvledger.engine.kv.quantized_store import QuantizedKVStore


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_a_chunk_that_fills_the_partial_block_and_opens_the_next_needs_one_buffer(fmt):
    bs, heads, dim = 16, 2, 64
    keys, values = make_codecs(fmt, bs, heads, dim, 32, "per-channel")
    store = QuantizedKVStore(1, 4, bs, heads, dim, fmt, keys, values, torch.float32,
                             residual_slots=1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, heads, dim, generator=gen)
    store.write(0, torch.arange(0, 10), x[:10], -x[:10])  # block 0 partial: its residual
    store.write(0, torch.arange(10, 21), x[10:21], -x[10:21])  # fills block 0, opens block 1
    store.write(0, torch.arange(21, 40), x[21:40], -x[21:40])  # fills block 1, opens block 2
    k, v = store.read_blocks(0, torch.tensor([0, 1, 2]))
    # full blocks come back as the codec's own round trip of the same 16 rows
    for b in (0, 1):
        rows = x[b * bs:(b + 1) * bs][None]
        want_k = keys.decode(keys.encode(rows), torch.float32)[0]
        want_v = values.decode(values.encode(-rows), torch.float32)[0]
        assert torch.equal(k[b], want_k) and torch.equal(v[b], want_v)
    # the partial block is the residual: exact
    assert torch.equal(k[2, :8], x[32:40]) and torch.equal(v[2, :8], -x[32:40])
    assert int((store.residual_of >= 0).sum()) == 1


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_decode_writes_one_token_at_a_time_into_the_buffer_and_quantize_the_block_once_full(fmt):
    """Decode steps write one token per sequence: it lands in the sequence's residual buffer
    (exact), a buffer that another block used before starts from zeros again, and the step
    whose token fills the block stores the codec's round trip of all 16 rows."""
    bs, heads, dim = 16, 2, 64
    keys, values = make_codecs(fmt, bs, heads, dim, 32, "per-channel")
    store = QuantizedKVStore(1, 4, bs, heads, dim, fmt, keys, values, torch.float32,
                             residual_slots=2)
    x = torch.randn(2 * bs, heads, dim, generator=torch.Generator().manual_seed(3))
    store.write(0, torch.arange(0, 9), x[:9] + 5, x[:9] + 5)  # block 0: partial, 9 stale rows
    store.release(0)  # freed while partial: its buffer goes back with stale rows in it
    for t in range(bs):  # two sequences, one token each per step: blocks 1 and 3
        rows = x[[t, bs + t]]
        store.write(0, torch.tensor([bs + t, 3 * bs + t]), rows, -rows)
        if t == 4:  # mid-block: the first 5 rows exactly, the rest zeros, not block 0's rows
            k, v = store.read_blocks(0, torch.tensor([1, 3]))
            assert torch.equal(k[0, :5], x[:5]) and torch.equal(k[1, :5], x[bs:bs + 5])
            assert torch.equal(v[0, :5], -x[:5])
            assert not k[:, 5:].any() and not v[:, 5:].any()
    k, v = store.read_blocks(0, torch.tensor([1, 3]))
    for i, rows in enumerate((x[:bs], x[bs:])):  # full: one quantization of the whole block
        assert torch.equal(k[i], keys.decode(keys.encode(rows[None]), torch.float32)[0])
        assert torch.equal(v[i], values.decode(values.encode(-rows[None]), torch.float32)[0])
    assert int((store.residual_of >= 0).sum()) == 0
