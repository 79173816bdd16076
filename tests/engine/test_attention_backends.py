"""The paged backends against the reference one (gather + SDPA) on random block tables.

The reference backend is itself checked against transformers (tests/model/test_llama.py); here every
backend must give the same attention output from the same pool: fp32 within 1e-4, bf16 within
bf16 rounding of the output (the kernels accumulate in fp32 in a different order).
"""

from __future__ import annotations

import pytest
import torch

from kvledger.device import resolve
from kvledger.engine.attention import AttentionMetadata, PrefillSegment, make_backend
from kvledger.engine.kv.store import KVStore
from kvledger.engine.runner import _decode_group, _prefix_causal_mask

KERNELS = resolve("cpu").kernels

BLOCK = 16
PAGED = ["paged-torch", "paged-native"]


def _store(kv_heads, dim, dtype, num_blocks=40, seed=0):
    store = KVStore(1, num_blocks, BLOCK, kv_heads, dim, dtype)
    g = torch.Generator().manual_seed(seed)
    store.key_blocks[0].copy_(torch.randn(store.key_blocks[0].shape, generator=g))
    store.value_blocks[0].copy_(torch.randn(store.value_blocks[0].shape, generator=g))
    return store


def _slots(table, length):
    blocks = torch.tensor(table, dtype=torch.int64)
    return (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:length]


def _decode_meta(tables, lengths):
    group = _decode_group(0, [_slots(t, n) for t, n in zip(tables, lengths)])
    return AttentionMetadata(slot_mapping=None, decodes=[group])


def _run(name, q, meta, store):
    empty = torch.empty(0, store.key_blocks[0].shape[2], q.shape[-1], dtype=q.dtype)
    return make_backend(name, KERNELS)(0, q, empty, empty, meta, store)


def _random_tables(lengths, num_blocks, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randperm(num_blocks, generator=g)[: -(-n // BLOCK)].tolist() for n in lengths]


CASES = {
    "mixed lengths": [37, 5, 160, 90],
    "length 1": [1, 1, 2],
    "block boundary": [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1],
    "one sequence": [300],
    "long (several chunks)": [BLOCK * 37 + 3],
}


@pytest.mark.parametrize("backend", PAGED)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_matches_reference_fp32(backend, heads, kv_heads, case):
    lengths = CASES[case]
    store = _store(kv_heads, 64, torch.float32, num_blocks=64)
    tables = _random_tables(lengths, 64, seed=len(case))
    q = torch.randn(len(lengths), heads, 64, generator=torch.Generator().manual_seed(3))
    want = _run("reference", q, _decode_meta(tables, lengths), store)
    got = _run(backend, q, _decode_meta(tables, lengths), store)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-4


@pytest.mark.parametrize("backend", PAGED)
def test_decode_shared_blocks_match_reference(backend):
    """Sequences that share a prefix block (as after a prefix-cache hit) and one that does not."""
    store = _store(3, 64, torch.float32)
    tables = [[7, 2, 9], [7, 2, 30], [7, 11], [5]]
    lengths = [40, 35, 20, 9]
    q = torch.randn(4, 9, 64, generator=torch.Generator().manual_seed(5))
    want = _run("reference", q, _decode_meta(tables, lengths), store)
    got = _run(backend, q, _decode_meta(tables, lengths), store)
    assert float((got - want).abs().max()) <= 1e-4


@pytest.mark.parametrize("backend", PAGED)
@pytest.mark.parametrize("prefix,new", [(16, 9), (33, 15), (1, 1), (47, 50)])
def test_prefill_after_prefix_matches_reference(backend, prefix, new):
    store = _store(3, 64, torch.float32)
    table = [12, 3, 25, 8, 0, 19, 6]
    seg = lambda: PrefillSegment(0, new, _slots(table, prefix + new),
                                 _prefix_causal_mask(prefix, new))
    q = torch.randn(new, 9, 64, generator=torch.Generator().manual_seed(prefix))
    want = _run("reference", q, AttentionMetadata(None, prefills=[seg()]), store)
    got = _run(backend, q, AttentionMetadata(None, prefills=[seg()]), store)
    assert float((got - want).abs().max()) <= 1e-4


@pytest.mark.parametrize("backend", PAGED)
def test_bf16_pool_matches_reference(backend):
    store = _store(3, 64, torch.bfloat16)
    lengths = [70, 3, 33]
    tables = _random_tables(lengths, 40, seed=9)
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    want = _run("reference", q, _decode_meta(tables, lengths), store).float()
    got = _run(backend, q, _decode_meta(tables, lengths), store)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max()) <= 2e-2  # a few bf16 ulps at |x| ~ 1


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (6, 2)])
@pytest.mark.parametrize("lengths", [[1], [BLOCK * 37 + 3], [5, BLOCK * 9 + 1]])
def test_native_split_context_matches_reference(monkeypatch, threads, heads, kv_heads, lengths):
    """Contexts cut into parts across threads (batch-1 decode) and merged give the same output."""
    from kvledger.device.cpu.native import PagedKernel

    monkeypatch.setattr(PagedKernel, "THREAD_WORK", 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        store = _store(kv_heads, 64, torch.float32, num_blocks=64)
        tables = _random_tables(lengths, 64, seed=threads)
        q = torch.randn(len(lengths), heads, 64, generator=torch.Generator().manual_seed(2))
        want = _run("reference", q, _decode_meta(tables, lengths), store)
        got = _run("paged-native", q, _decode_meta(tables, lengths), store)
    finally:
        torch.set_num_threads(previous)
    assert float((got - want).abs().max()) <= 1e-4


def _bf16_pair(kv_heads, dim, num_blocks=64):
    """A bf16 pool and an fp32 pool holding the same values: the fp32 reference sees exactly
    what the bf16 kernel reads, so only the kernel's fp32 sums and the output's rounding differ."""
    narrow = _store(kv_heads, dim, torch.bfloat16, num_blocks=num_blocks)
    wide = KVStore(1, num_blocks, BLOCK, kv_heads, dim, torch.float32)
    wide.key_blocks[0].copy_(narrow.key_blocks[0].float())
    wide.value_blocks[0].copy_(narrow.value_blocks[0].float())
    return narrow, wide


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim", [64, 128])  # four and eight pairs per row
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 1)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("case", sorted(CASES))
def test_native_bf16_pair_order_matches_fp32_reference(monkeypatch, threads, dim, heads,
                                                       kv_heads, case):
    """bf16 rows read as even / odd lanes (paged_plain.h), on one thread and with the context
    cut into parts whose items take every KV head (split reduction), against the reference
    in fp32 over the same values: within the output's bf16 rounding (2^-8 relative)."""
    from kvledger.device.cpu.native import PagedKernel

    monkeypatch.setattr(PagedKernel, "THREAD_WORK", 0)
    lengths = CASES[case]
    narrow, wide = _bf16_pair(kv_heads, dim)
    tables = _random_tables(lengths, 64, seed=len(case) + dim)
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(7))
    q = q.bfloat16()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _run("paged-native", q, _decode_meta(tables, lengths), narrow).float()
    finally:
        torch.set_num_threads(previous)
    want = _run("reference", q.float(), _decode_meta(tables, lengths), wide)
    assert float(((got - want).abs() / (want.abs() + 1e-2)).max()) <= 2 ** -7


@pytest.mark.parametrize("prefix,new", [(16, 9), (33, 15), (1, 1), (47, 50)])
def test_native_bf16_prefill_after_prefix_matches_fp32_reference(prefix, new):
    narrow, wide = _bf16_pair(3, 64, num_blocks=40)
    table = [12, 3, 25, 8, 0, 19, 6]
    seg = lambda: PrefillSegment(0, new, _slots(table, prefix + new),
                                 _prefix_causal_mask(prefix, new))
    q = torch.randn(new, 9, 64, generator=torch.Generator().manual_seed(prefix)).bfloat16()
    want = _run("reference", q.float(), AttentionMetadata(None, prefills=[seg()]), wide)
    got = _run("paged-native", q, AttentionMetadata(None, prefills=[seg()]), narrow).float()
    assert float(((got - want).abs() / (want.abs() + 1e-2)).max()) <= 2 ** -7


@pytest.mark.parametrize("dim", [128, 40, 36])  # unrolled 128; generic multiple of 8; fallback
def test_paged_head_dims_match_reference(dim):
    """Other head sizes: 128 has its own unrolled code, 40 the generic loop, and 36 (not a
    multiple of 8 lanes) is refused by the native kernel and served by paged-torch."""
    store = _store(2, dim, torch.float32)
    lengths = [50, 17]
    tables = _random_tables(lengths, 40, seed=dim)
    q = torch.randn(2, 4, dim, generator=torch.Generator().manual_seed(dim))
    want = _run("reference", q, _decode_meta(tables, lengths), store)
    for backend in PAGED:
        got = _run(backend, q, _decode_meta(tables, lengths), store)
        assert float((got - want).abs().max()) <= 1e-4, backend


def test_split_keeps_every_thread_busy():
    from kvledger.device.cpu.native import PagedKernel

    assert PagedKernel.split(3, 32, 2) == 2  # batch-1, 3 kv heads on 2 threads: cut in two
    assert PagedKernel.split(4, 32, 2) == 1  # already even
    assert PagedKernel.split(3, 3, 2) == 1  # too few blocks to cut
    assert PagedKernel.split(3, 32, 1) == 1


def test_native_falls_back_to_torch_when_disabled(monkeypatch, caplog):
    from kvledger.device.cpu import native

    monkeypatch.setenv("KVLEDGER_NATIVE", "0")
    native.library.cache_clear()
    native.load.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="kvledger"):
            assert make_backend("paged-native", KERNELS).name == "paged-torch"
        assert "KVLEDGER_NATIVE=0" in caplog.text  # the fallback is said, as the README says
    finally:
        native.library.cache_clear()
        native.load.cache_clear()


def test_unknown_backend_is_a_clear_error():
    from kvledger.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="attention backend"):
        make_backend("flash", KERNELS)
