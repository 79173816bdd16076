"""The scheduler's bookkeeping invariants, asserted by tests and in debug mode."""

from __future__ import annotations

from typing import Any

from kvledger.engine.request import NULL_BLOCK, RequestStatus


def check_invariants(scheduler: Any) -> None:
    """Assert the bookkeeping invariants of ``scheduler`` (a ``Scheduler``; O(blocks +
    requests)).

    The pool's accounting (pool.py); each block's refcount equals the number of block tables
    holding it; a running table covers its computed tokens; waiting requests hold nothing;
    long requests stay within their share; the registry holds exactly the waiting and running
    requests, each once.
    """
    queued = list(scheduler.waiting) + scheduler.running
    assert len({id(r) for r in queued}) == len(queued), "a request queued twice"
    assert {r.request_id: r for r in queued} == scheduler.requests, "registry != queues"
    pool = scheduler.kv.pool
    pool.check_invariants()
    holders = [0] * pool.num_blocks
    for req in scheduler.running:
        assert req.status is RequestStatus.RUNNING
        assert len(req.block_table) * scheduler.block_size >= req.num_kv_slots
        for g, table in enumerate(req.block_tables):
            dropped = req.num_dropped_blocks if g in scheduler.kv.sliding else 0
            assert all(b == NULL_BLOCK for b in table[:dropped])
            for block_id in table[dropped:]:
                holders[block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == holders, "refcount != block-table holders"
    for req in scheduler.waiting:
        assert req.status is RequestStatus.WAITING
        assert req.block_table == [] and req.num_computed_tokens == 0
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    long_held = sum(r.num_blocks_held for r in scheduler.running if r.is_long)
    assert long_held <= scheduler.long_budget.max_blocks
