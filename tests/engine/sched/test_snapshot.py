"""The scheduler's read models (``engine/sched/snapshot.py``): ``pool_stats()`` and
``snapshot()`` give what the pool and the queues hold, and cannot be changed.

Expected figures are worked out by hand: 4-token blocks, a 10-token prompt holds 3 blocks once
prefilled (ceil(10 / 4)); its 2 full blocks stay in the prefix cache once it finishes.
"""

from __future__ import annotations

import dataclasses

import pytest
from sched_harness import Harness

from kvledger.engine.sched.snapshot import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED

PROMPT = list(range(1, 11))  # 10 tokens


def test_pool_stats_count_blocks_without_walking_them():
    h = Harness(num_blocks=8, block_size=4)
    stats = h.sched.pool_stats()
    assert (stats.blocks_total, stats.blocks_free, stats.blocks_in_use, stats.blocks_cached) \
        == (8, 8, 0, 0)
    assert (stats.block_size, stats.bytes_per_block) == (4, 1000)


def test_snapshot_lists_running_then_waiting_with_their_blocks():
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=1)
    h.add("a", PROMPT, 2)
    h.add("b", PROMPT[:3], 2)
    h.step()  # "a" prefilled in one step; "b" waits (one sequence at a time)
    snap = h.sched.snapshot()
    a, b = snap.requests
    assert (a.request_id, a.state, a.prompt_tokens, a.output_tokens) == ("a", "running", 10, 1)
    assert (a.computed_tokens, a.blocks_held, len(a.block_ids)) == (10, 3, 3)
    assert (b.request_id, b.state, b.blocks_held, b.block_ids) == ("b", "waiting", 0, ())
    assert snap.pool.blocks_in_use == 3 and snap.pool.blocks_free == 5
    assert [snap.block_states[i] for i in a.block_ids] == [BLOCK_USED] * 3
    assert snap.block_states.count(BLOCK_FREE) == 5
    assert snap.quota_tokens is None


def test_snapshot_shows_cached_blocks_after_the_request_finishes():
    h = Harness(num_blocks=8, block_size=4)
    h.add("a", PROMPT, 1)
    h.run()
    snap = h.sched.snapshot()
    assert snap.requests == ()
    assert snap.block_states.count(BLOCK_CACHED) == 2  # the 2 full prompt blocks
    assert snap.pool.blocks_cached == 2 and snap.pool.blocks_in_use == 0


def test_a_snapshot_is_frozen():
    snap = Harness(num_blocks=2, block_size=4).sched.snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.pool.blocks_free = 0
