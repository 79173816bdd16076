"""Memory of the engine: the KV pool is not touched before use, and the weight cache's pages
are handed back as the model takes its own formats (without changing any value)."""

from __future__ import annotations

import torch

from kvledger.engine.kv.store import KVStore, lazy_zeros
from kvledger.model.weights.loader import MappedWeights, load_weights


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_new_pool_costs_no_memory_until_written():
    before = _rss_bytes()
    store = KVStore(4, 2048, 16, 4, 64, torch.float32)  # 4 x 2 x 32 MiB = 256 MiB reserved
    assert store.nbytes == 4 * 2 * 2048 * 16 * 4 * 64 * 4
    assert _rss_bytes() - before < 32 << 20  # far below the reserved bytes
    assert float(store.key_blocks[3][2047].abs().sum()) == 0.0  # reads as zeros
    store.write(0, torch.tensor([5, 17]), torch.ones(2, 4, 64), torch.full((2, 4, 64), 2.0))
    assert float(store.key_blocks[0].view(-1, 4, 64)[17].sum()) == 4 * 64
    assert float(store.value_blocks[0].view(-1, 4, 64)[5].mean()) == 2.0


def test_lazy_zeros_shape_and_dtype():
    t = lazy_zeros((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert lazy_zeros((0, 4), torch.float32).numel() == 0


def test_release_keeps_values_of_mapped_and_of_ordinary_tensors():
    load_weights("default", torch.bfloat16)  # a fresh machine's first load writes the cache
    _, weights = load_weights("default", torch.bfloat16)  # cached: memory-mapped
    assert isinstance(weights, MappedWeights)
    name = "model.layers.3.mlp.down_proj.weight"
    want = weights[name].clone()
    weights.release(weights[name])  # the pages go; a read brings them back from the file
    assert torch.equal(weights[name], want)
    ordinary = torch.arange(1 << 20, dtype=torch.float32)  # not the file: never released
    weights.release(ordinary)
    assert torch.equal(ordinary, torch.arange(1 << 20, dtype=torch.float32))
