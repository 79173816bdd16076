"""The hybrid KV pool (issue 34 item 6): full and sliding layer groups over one pool of pages.

The expected figures come from the definitions, not from the code under test: a sliding layer
of window W at length t needs the keys of positions max(0, t - W + 1) .. t - 1 (query i sees key
j when i - j < W), counted position by position here; a full layer needs every position.
"""

from __future__ import annotations

import pytest

from kvledger.data import config_path
from kvledger.engine.kv.manager import KVCacheManager
from kvledger.engine.request import NULL_BLOCK, Request
from kvledger.ledger.kv import kv_bytes_per_page, kv_bytes_per_sequence
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.kv_groups import kv_groups, peak_blocks, sequence_blocks
from kvledger.model.families import spec_from_hf_config
from kvledger.spec import FULL, SLIDING

BF16 = KVFormatSpec("bf16")
BS = 16


def _gemma3_1b():
    return spec_from_hf_config(config_path("google__gemma-3-1b-it"))


def _blocks_seen(tokens: int, window: int | None, block: int) -> int:
    """Blocks of the positions the next query sees, counted one position at a time."""
    first = 0 if window is None else max(0, tokens - window + 1)
    return len({j // block for j in range(first, tokens)})


def test_gemma3_1b_groups_cover_every_layer_once_in_equal_widths():
    spec = _gemma3_1b()
    groups = kv_groups(spec)
    assert [g.kind for g in groups] == [FULL] * 2 + [SLIDING] * 11
    assert {len(g.layers) for g in groups} == {2}
    assert sorted(i for g in groups for i in g.layers) == list(range(26))
    assert all(spec.layers.types[i] == g.kind for g in groups for i in g.layers)


def _in_use(req: Request) -> list[int]:
    return [b for table in req.block_tables for b in table if b != NULL_BLOCK]


def _run_to(mgr: KVCacheManager, req: Request, end: int, chunk: int, check) -> None:
    """Compute ``req`` up to ``end`` tokens in chunks, calling ``check(t)`` between steps."""
    while req.num_computed_tokens < end:
        n = min(chunk, end - req.num_computed_tokens)
        assert mgr.allocate_slots(req, n)
        req.num_computed_tokens += n
        mgr.cache_full_blocks(req)
        mgr.retain(req)
        check(req.num_computed_tokens)


@pytest.mark.parametrize("chunk", [1, 7, 512])
def test_blocks_in_use_equal_the_ledger_at_every_length(chunk):
    """Gemma-3-1B's layout in a pool of pages: between steps the pages a sequence holds in use
    equal the ledger's figure, and each group holds the blocks its layers' next query sees."""
    spec = _gemma3_1b().with_fields(sliding_window=40)  # small W: many window turns
    groups = kv_groups(spec)
    page = kv_bytes_per_page(spec, BF16, 1, BS)
    mgr = KVCacheManager(4000, BS, True, None, groups)
    req = Request("a", list(range(700)))

    def check(t):
        used = _in_use(req)
        assert not any(mgr.pool.is_free(b) for b in used)
        assert len(used) == sequence_blocks(groups, t, BS)
        assert len(used) * page == kv_bytes_per_sequence(spec, BF16, 1, BS, t, paged=True)
        for g, table in zip(groups, req.block_tables):
            live = [b for b in table if b != NULL_BLOCK]
            assert len(live) == _blocks_seen(t, g.window, BS), (t, g.kind)
        assert mgr.pool.num_in_use == len(used)

    _run_to(mgr, req, 700, chunk, check)


def test_gemma3_1b_at_8192_tokens_holds_the_ledgers_share_of_all_global_layers():
    """(4 x 8,192 + 22 x 512) / (26 x 8,192) ~ 0.21; in whole blocks 2,752 / 13,312 layer
    blocks: 4 global layers 512 blocks each, 22 sliding ones the 32 blocks of positions
    7,681 .. 8,191. Counted by the pool, against the same shape with every layer global."""
    spec = _gemma3_1b()
    every_global = spec.with_fields(layer_types=(FULL,) * 26, sliding_window=None)
    held = {}
    for name, s in (("hybrid", spec), ("global", every_global)):
        groups = kv_groups(s)
        mgr = KVCacheManager(20000, BS, False, None, groups)
        req = Request("a", list(range(8193)))
        _run_to(mgr, req, 8192, 2048, lambda t: None)
        held[name] = mgr.pool.num_in_use * kv_bytes_per_page(s, BF16, 1, BS)
    layer_block = 16 * 1 * 256 * 2 * 2  # tokens x KV heads x head_dim x (K, V) x bf16 bytes
    assert held["hybrid"] == (4 * 512 + 22 * 32) * layer_block
    assert held["global"] == 26 * 512 * layer_block
    assert held["hybrid"] / held["global"] == 2752 / 13312
    assert round(held["hybrid"] / held["global"], 2) == 0.21


def test_blocks_that_leave_the_window_are_evictable_cached_blocks():
    spec = _gemma3_1b().with_fields(sliding_window=40)
    mgr = KVCacheManager(400, BS, True, None, kv_groups(spec))
    req = Request("a", list(range(200)))
    _run_to(mgr, req, 160, 16, lambda t: None)
    # 160 tokens: 10 full blocks hashed; sliding groups hold positions 121..159, blocks 7..9,
    # so blocks 0..6 of each of the 11 sliding groups went back, still in the prefix cache
    assert mgr.pool.num_evictable == 11 * 7
    assert mgr.pool.num_in_use == 2 * 10 + 11 * 3


def _hit_by_definition(present: dict, groups, most: int) -> int:
    """Longest L <= most: full groups hold blocks 0..L-1, sliding ones those of positions
    max(0, L*B - W + 1) .. L*B - 1 (vLLM's hybrid rule)."""
    for length in range(most, -1, -1):
        ok = True
        for g, group in enumerate(groups):
            first = 0 if group.window is None else max(0, length * BS - group.window + 1)
            needed = {j // BS for j in range(first, length * BS)}
            ok &= all(present[g][i] for i in needed)
        if ok:
            return length
    return 0


def test_a_hit_is_the_longest_prefix_every_group_holds_and_a_miss_is_counted():
    spec = _gemma3_1b().with_fields(sliding_window=40)
    groups = kv_groups(spec)
    mgr = KVCacheManager(600, BS, True, None, groups)
    a = Request("a", list(range(300)))
    _run_to(mgr, a, 300, 64, lambda t: None)
    mgr.free(a)
    b = Request("b", list(range(300)) + [7])
    hit = mgr.find_longest_cache_hit(b)
    assert len(hit[0]) == 300 // BS  # everything cached: the whole prompt's full blocks
    # one sliding group's block 17 evicted (as allocation pressure does): no hit may need it
    mgr.pool._evict(mgr.pool.blocks[mgr.prefix._cached(b, 4, 17)])
    present = [[mgr.prefix._cached(b, g, i) is not None for i in range(18)]
               for g in range(len(groups))]
    hit = mgr.find_longest_cache_hit(b)
    assert len(hit[0]) == _hit_by_definition(present, groups, 300 // BS)
    assert b.missed_hit_tokens == (300 // BS - len(hit[0])) * BS > 0
    assert mgr.allocate_slots(b, b.num_tokens - len(hit[0]) * BS, hit)
    assert mgr.prefix.missed_tokens == b.missed_hit_tokens


@pytest.mark.parametrize("window", [1, 5, 16, 40, 512])
def test_peak_pages_are_the_most_held_one_token_at_a_time(window):
    spec = _gemma3_1b().with_fields(sliding_window=window)
    groups = kv_groups(spec)
    for n in range(3 * window + 40):
        brute = max((sequence_blocks(groups, t, BS, 1) for t in range(n)), default=0)
        assert peak_blocks(groups, n, BS) == brute, n
