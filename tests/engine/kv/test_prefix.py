"""Prefix cache: chained hashes, salt isolation, the last-token cap, verification, counters."""

from __future__ import annotations

import hashlib

from kvledger.engine.kv.manager import KVCacheManager
from kvledger.engine.request import Request

BS = 4


def computed(mgr: KVCacheManager, req: Request) -> Request:
    """Admit ``req`` with its prefix hit, compute all its tokens, cache its full blocks."""
    hit = mgr.find_longest_cache_hit(req)
    assert mgr.allocate_slots(req, req.num_tokens - len(hit[0]) * BS, hit)
    req.num_computed_tokens = req.num_tokens
    mgr.cache_full_blocks(req)
    return req


def test_first_block_hash_matches_documented_formula():
    mgr = KVCacheManager(8, BS)
    req = Request("a", [5, 6, 7, 8, 9])
    digest, key = mgr.prefix.block_hash(req, 0)
    assert key == (None, (5, 6, 7, 8), ())
    assert digest == hashlib.sha256(repr((None, (5, 6, 7, 8), ())).encode()).digest()
    salted = Request("b", [5, 6, 7, 8, 9], cache_salt="tenant-1")
    assert mgr.prefix.block_hash(salted, 0)[1] == (None, (5, 6, 7, 8), ("tenant-1",))


def test_hash_chains_over_the_parent():
    mgr = KVCacheManager(8, BS)
    a = Request("a", [1, 2, 3, 4, 9, 9, 9, 9])
    b = Request("b", [0, 2, 3, 4, 9, 9, 9, 9])  # same second block, different first
    assert mgr.prefix.block_hash(a, 0)[0] != mgr.prefix.block_hash(b, 0)[0]
    assert mgr.prefix.block_hash(a, 1)[0] != mgr.prefix.block_hash(b, 1)[0]


def test_hit_is_capped_before_the_last_token():
    mgr = KVCacheManager(16, BS)
    computed(mgr, Request("a", list(range(12))))  # 3 full blocks cached
    # 8 tokens = exactly 2 cached blocks: only (8 - 1) // 4 = 1 block may hit.
    assert len(mgr.find_longest_cache_hit(Request("b", list(range(8))))[0]) == 1
    assert len(mgr.find_longest_cache_hit(Request("c", list(range(9))))[0]) == 2
    assert len(mgr.find_longest_cache_hit(Request("d", list(range(13))))[0]) == 3


def test_salt_isolates_tenants():
    mgr = KVCacheManager(16, BS)
    computed(mgr, Request("a", list(range(9)), cache_salt="x"))
    assert mgr.find_longest_cache_hit(Request("b", list(range(9)), cache_salt="y")) == [[]]
    assert mgr.find_longest_cache_hit(Request("c", list(range(9)))) == [[]]
    assert len(mgr.find_longest_cache_hit(Request("d", list(range(9)), cache_salt="x"))[0]) == 2


def test_hit_is_verified_against_the_stored_key():
    mgr = KVCacheManager(16, BS)
    a = computed(mgr, Request("a", list(range(9))))
    block = mgr.pool.blocks[a.block_table[0]]
    block.hash_key = (None, (9, 9, 9, 9), ())  # a forged collision: same hash, other tokens
    assert mgr.find_longest_cache_hit(Request("b", list(range(9)))) == [[]]


def test_generated_tokens_are_cached_once_computed():
    mgr = KVCacheManager(16, BS)
    a = computed(mgr, Request("a", [1, 2, 3, 4, 5, 6]))
    a.output_token_ids += [7, 8, 10]  # tokens 6.. : block 1 = [5, 6, 7, 8] is full
    assert mgr.allocate_slots(a, 3)
    a.num_computed_tokens += 3
    mgr.cache_full_blocks(a)
    follow_up = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 10, 11])  # a multi-turn continuation
    assert mgr.find_longest_cache_hit(follow_up) == [a.block_table[:2]]


def test_counters_and_disabled_cache():
    mgr = KVCacheManager(16, BS)
    computed(mgr, Request("a", list(range(10))))
    computed(mgr, Request("b", list(range(10))))
    # Hand count: queried 10 + 10 tokens; b hit 2 full blocks = 8 tokens.
    assert (mgr.prefix.queried_tokens, mgr.prefix.hit_tokens) == (20, 8)
    off = KVCacheManager(16, BS, enable_prefix_caching=False)
    off.free(computed(off, Request("a", list(range(10)))))
    assert off.find_longest_cache_hit(Request("b", list(range(10)))) == [[]]
    assert (off.prefix.queried_tokens, off.prefix.hit_tokens, off.pool.num_evictable) == (0, 0, 0)
