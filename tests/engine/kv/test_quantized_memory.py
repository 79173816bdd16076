"""A quantized pool costs no RAM until its blocks are written (as the full-precision one)."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.kv.codecs import make_codecs
from kvledger.engine.kv.quantized_store import QuantizedKVStore


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_a_new_quantized_pool_costs_no_memory_until_written(fmt):
    layers, blocks, bs, heads, dim = 4, 16384, 16, 4, 64
    keys, values = make_codecs(fmt, bs, heads, dim, 32, "per-channel")
    before = _rss_bytes()
    store = QuantizedKVStore(layers, blocks, bs, heads, dim, fmt, keys, values, torch.float32,
                             residual_slots=64)
    assert store.nbytes > 128 << 20  # int4's codes alone: 4 x 2 x 16384 x 16 x 4 x 32 B
    assert _rss_bytes() - before < 32 << 20  # far below the reserved bytes
    ids = torch.tensor([blocks - 1])
    k, v = store.read_blocks(3, ids)
    assert float(k.abs().sum()) == 0.0 and float(v.abs().sum()) == 0.0  # zeros decode to 0
    x = torch.linspace(-1, 1, bs * heads * dim).view(bs, heads, dim)
    slots = (blocks - 1) * bs + torch.arange(bs)  # fills the last block: quantized at once
    store.write(3, slots, x, 2 * x)
    k, v = store.read_blocks(3, ids)
    assert float((k[0] - x).abs().max()) < 0.1 and float((v[0] - 2 * x).abs().max()) < 0.2
