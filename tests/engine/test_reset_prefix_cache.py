"""LLMEngine.reset_prefix_cache: every evictable block leaves the prefix cache, no block in use
is touched (the running request's tokens are those it gets alone, fp32 greedy)."""

from __future__ import annotations

import random

from kvledger.engine.sample.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _finish(engine, request_id: str, prompt: list[int]):
    engine.add_request(request_id, prompt, GREEDY)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                return out


def test_reset_drops_evictable_blocks_and_keeps_the_running_ones(tiny_engine_factory):
    rng = random.Random(5)
    a, b = ([rng.randrange(3, 320) for _ in range(40)] for _ in range(2))  # 2 full blocks each
    alone_b = _finish(tiny_engine_factory(), "b", b).token_ids
    engine = tiny_engine_factory()
    first_a = _finish(engine, "a", a)
    pool = engine.scheduler.kv.pool
    assert pool.num_evictable == 2  # a's 40 prompt + 7 fed outputs = 47 tokens: 2 full blocks
    engine.add_request("b", b, GREEDY)
    for _ in range(2):  # b's prefill then one decode: its 2 prompt blocks are cached
        (out,) = engine.step()
    held = [blk for blk in engine.scheduler.requests["b"].block_table
            if pool.blocks[blk].block_hash is not None]
    assert len(held) == 2
    assert engine.reset_prefix_cache() == 2
    assert pool.num_evictable == 0
    assert all(pool.blocks[blk].block_hash is not None for blk in held)  # in use: untouched
    pool.check_invariants()
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    assert out.finished and out.token_ids == alone_b
    again_a = _finish(engine, "a2", a)
    assert again_a.metrics.num_cached_tokens == 0 and again_a.token_ids == first_a.token_ids
    again_b = _finish(engine, "b2", b)
    assert again_b.metrics.num_cached_tokens == 32  # b's blocks survived the reset
