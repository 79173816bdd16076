"""Helpers of the speculative-decoding tests: run an engine to the end, checking the pool and
the ledger after every step."""

from __future__ import annotations

from kvledger.ledger.kv_groups import sequence_blocks

NGRAM = {"method": "ngram", "gate": False}
SUFFIX = {"method": "suffix", "gate": False}


def run(engine, prompts, params, check: bool = True) -> list:
    """Final outputs in prompt order; with ``check``, after every step the scheduler's
    invariants hold and every running request holds exactly the blocks the ledger prices at
    its computed tokens (no block a rejected proposal took is left over)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params if not isinstance(params, list) else params[i])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            check_ledger(engine)
    return [done[f"r{i}"] for i in range(len(prompts))]


def check_ledger(engine) -> None:
    """Scheduler invariants, and blocks held = ``kv_groups.sequence_blocks`` per request."""
    sched = engine.scheduler
    sched.check_invariants()
    for req in sched.running:
        assert req.num_blocks_held == sequence_blocks(
            engine.kv_layout.groups, req.num_kv_slots, engine.config.block_size), req.request_id


def assert_idle_whole(engine) -> None:
    """Nothing running, every block free, the pool's accounting whole."""
    s = engine.stats()
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    engine.scheduler.kv.pool.check_invariants()


def tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]
