"""KVCacheManager: all-or-nothing slot allocation, shared prefix blocks, tail-first free."""

from __future__ import annotations

from kvledger.engine.kv.manager import KVCacheManager
from kvledger.engine.request import Request

BS = 4


def test_allocate_slots_is_all_or_nothing():
    mgr = KVCacheManager(4, BS)
    req = Request("a", list(range(17)))  # 17 tokens need ceil(17 / 4) = 5 blocks > 4
    assert not mgr.allocate_slots(req, 17)
    assert req.block_table == [] and mgr.pool.num_free == 4
    assert mgr.allocate_slots(req, 16)
    assert len(req.block_table) == 4 and req.peak_num_blocks == 4


def test_slots_grow_one_block_per_block_size_tokens():
    mgr = KVCacheManager(8, BS)
    req = Request("a", list(range(5)))
    assert mgr.allocate_slots(req, 5) and len(req.block_table) == 2
    req.num_computed_tokens = 5
    for n_tokens, n_blocks in [(6, 2), (7, 2), (8, 2), (9, 3)]:  # slots for tokens [0, n)
        req.output_token_ids.append(0)
        assert mgr.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert (req.num_computed_tokens, len(req.block_table)) == (n_tokens, n_blocks)


def test_shared_hit_blocks_take_nothing_from_the_free_list():
    mgr = KVCacheManager(6, BS)
    a = Request("a", list(range(10)))
    assert mgr.allocate_slots(a, 10)  # 3 blocks
    a.num_computed_tokens = 10
    mgr.cache_full_blocks(a)
    b = Request("b", list(range(8)) + [50, 51, 52])  # shares a's 2 full blocks
    hit = mgr.find_longest_cache_hit(b)
    assert hit == [a.block_table[:2]]
    assert mgr.blocks_needed(b, 3, hit) == (3, 1)  # table +3, only 1 block off the free list
    assert mgr.allocate_slots(b, 3, hit)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [mgr.pool.blocks[i].ref_cnt for i in a.block_table] == [2, 2, 1]
    assert mgr.pool.num_free == 6 - 4


def test_free_is_tail_first_and_keeps_prefix_blocks_cached():
    mgr = KVCacheManager(4, BS)
    a = Request("a", list(range(10)))
    assert mgr.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    mgr.cache_full_blocks(a)
    table = list(a.block_table)
    mgr.free(a)
    assert a.block_table == [] and mgr.pool.num_free == 4 and mgr.pool.num_evictable == 2
    # Hand-worked: the partial block 2 (unhashed) is reused first, then the untouched block 3,
    # then block 1 (deepest cached) before its parent block 0.
    assert mgr.pool.allocate(4) == [table[2], 3, table[1], table[0]]


def test_revived_cached_blocks_count_against_the_free_list():
    mgr = KVCacheManager(3, BS)
    a = Request("a", list(range(9)))
    assert mgr.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    mgr.cache_full_blocks(a)
    mgr.free(a)
    b = Request("b", list(range(9)))
    hit = mgr.find_longest_cache_hit(b)
    assert len(hit[0]) == 2
    assert mgr.blocks_needed(b, 1, hit) == (3, 3)  # 2 revived + 1 new, all from the free list
    assert mgr.allocate_slots(b, 1, hit) and mgr.pool.num_free == 0


def test_link_tiers_gets_the_pool_and_prefix_and_hears_blocks_entering_the_cache():
    class Link:
        def __init__(self, pool, prefix):
            self.pool, self.prefix, self.written = pool, prefix, []

        def write_through(self, block_id, block_hash, key):
            self.written.append(block_id)

    mgr = KVCacheManager(8, BS, link_tiers=Link)
    assert (mgr.tiers.pool, mgr.tiers.prefix) == (mgr.pool, mgr.prefix)
    req = Request("a", list(range(9)))  # 2 full blocks + 1 token
    assert mgr.allocate_slots(req, 9)
    req.num_computed_tokens = 9
    mgr.cache_full_blocks(req)
    assert mgr.tiers.written == req.block_table[:2]
    assert KVCacheManager(8, BS).prefix.on_cached is None  # no tiers: no write-through
