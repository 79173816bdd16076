"""BlockPool: free-list order, refcounts, eviction, and the accounting invariant under random use.

Expected orders are worked out by hand from the policy in the pool's docstring (vLLM v1's):
allocation pops the front; refcount-0 hashed blocks go to the tail, unhashed to the front.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.engine.kv.pool import BlockPool


def h(i: int) -> bytes:
    return f"hash{i}".encode()


def test_allocate_pops_front_and_counts():
    pool = BlockPool(5)
    assert pool.allocate(2) == [0, 1]
    assert (pool.num_free, pool.num_in_use, pool.num_evictable) == (3, 2, 0)
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.num_free == 0
    with pytest.raises(AssertionError):
        pool.allocate(1)


def test_touched_counts_each_block_once_however_often_it_cycles():
    # the store maps a block's pages on its first write: blocks 0-2 cycled 10 times map 3
    pool = BlockPool(8)
    for _ in range(10):
        pool.free(pool.allocate(3))  # unhashed: back to the front, reused next time
    assert pool.num_touched == 3
    a, b, c = pool.allocate(3)
    for i, block in enumerate((a, b, c)):
        pool.cache_block(block, h(i), (f"k{i}",))
    pool.free([c, b, a])  # hashed: to the tail, so the next allocation reaches 3, 4
    assert pool.allocate(2) == [3, 4]
    assert pool.num_touched == 5


def test_unhashed_free_goes_to_front_hashed_to_tail():
    pool = BlockPool(6)
    a, b, c, _ = pool.allocate(4)  # free list now [4, 5]
    pool.cache_block(a, h(0), ("k0",))
    pool.cache_block(b, h(1), ("k1",))
    pool.free(reversed([a, b, c]))  # tail-first: c (unhashed) -> front; b, a (hashed) -> tail
    assert (pool.num_free, pool.num_evictable, pool.num_in_use) == (5, 2, 1)
    # Hand-worked order: [c, 4, 5, b, a]: empty blocks first, then the deepest prefix block b.
    assert pool.allocate(4) == [c, 4, 5, b]
    assert pool.lookup(h(1)) is None  # b was evicted when re-allocated
    assert pool.lookup(h(0)).block_id == a  # its parent a survives
    assert pool.num_evictable == 1
    pool.check_invariants()


def test_touch_revives_cached_block_and_shares_in_use_block():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache_block(a, h(0), ("k",))
    pool.touch([a])  # shared by a second holder
    assert pool.blocks[a].ref_cnt == 2 and pool.num_free == 2
    pool.free([a])
    pool.free([a])
    assert pool.num_evictable == 1 and pool.is_free(a)
    pool.touch([a])  # prefix-cache hit on a free cached block
    assert pool.num_evictable == 0 and not pool.is_free(a) and pool.blocks[a].ref_cnt == 1
    assert pool.lookup(h(0)).block_id == a
    pool.check_invariants()


def test_evict_free_cached_drops_only_evictable_blocks():
    pool = BlockPool(5)
    a, b, c = pool.allocate(3)  # free list now [3, 4]
    for i, block in enumerate((a, b, c)):
        pool.cache_block(block, h(i), (f"k{i}",))
    pool.free([b, a])  # a and b evictable (tail: [3, 4, b, a]); c stays in use, cached
    assert pool.evict_free_cached() == 2
    assert pool.lookup(h(0)) is None and pool.lookup(h(1)) is None
    assert pool.lookup(h(2)).block_id == c and pool.blocks[c].ref_cnt == 1  # untouched
    assert (pool.num_free, pool.num_evictable, pool.num_in_use) == (4, 0, 1)
    assert pool.allocate(4) == [a, b, 3, 4]  # emptied blocks moved to the front
    assert pool.evict_free_cached() == 0
    pool.check_invariants()


def test_double_free_is_caught():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([a])


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(0), ("k",))
    assert not pool.cache_block(b, h(0), ("k",))
    assert pool.blocks[b].block_hash is None
    pool.free([b])
    assert pool.num_evictable == 0  # b was not cached, a is still in use


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "cache", "touch"]), st.integers(0, 7)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 8), ops=ops)
def test_random_use_keeps_accounting(num_blocks, ops):
    """Against a plain refcount model: refcounts >= 0, free + in use == total, cached <= free."""
    pool = BlockPool(num_blocks)
    refs = [0] * num_blocks  # the model
    held: list[int] = []  # one entry per reference we hold
    next_hash = 0
    for op, x in ops:
        if op == "alloc" and x <= pool.num_free:
            for b in pool.allocate(x):
                assert refs[b] == 0
                refs[b] = 1
                held.append(b)
        elif op == "free" and held:
            b = held.pop(x % len(held))
            pool.free([b])
            refs[b] -= 1
        elif op == "cache" and held:
            next_hash += 1
            pool.cache_block(held[x % len(held)], h(next_hash), (next_hash,))
        elif op == "touch":
            block = pool.lookup(h(x))
            if block is not None:
                pool.touch([block.block_id])
                refs[block.block_id] += 1
                held.append(block.block_id)
        pool.check_invariants()
        assert [b.ref_cnt for b in pool.blocks] == refs
        assert pool.num_free == refs.count(0)
        assert pool.num_free + pool.num_in_use == num_blocks
        assert pool.num_evictable <= pool.num_free
    pool.free(held)
    assert pool.num_free == num_blocks and pool.num_in_use == 0


def test_on_release_given_at_construction_hears_each_block_that_keeps_nothing():
    released: list[int] = []
    pool = BlockPool(3, on_release=released.append)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(1), ())
    pool.free([a, b])
    assert released == [b]  # block a stays in the prefix cache: nothing released yet
    pool.evict(a)
    assert released == [b, a]
