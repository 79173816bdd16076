"""Retention policies against the prefix cache, admission and the public faults of other
engines (vLLM #5537, transformers PR #38156, llama.cpp #3969 / #12161, kvpress PR #264 / #146).
Tiny random Llama, fp32."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError, KVBudgetError
from kvledger.ledger.retention import RetentionSpec

SHARED = [(11 * i + 5) % 300 + 3 for i in range(40)]  # a 40-token shared prefix (10 blocks)
SINKS = {"policy": "sinks", "window": 8, "sinks": 2, "positions": "original"}


def params(n, kv_policy=None, logprobs=None):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, kv_policy=kv_policy,
                          logprobs=logprobs)


def drain(engine, check=None) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        engine.scheduler.check_invariants()
        if check:
            check(engine)
    return outs


def test_window_smaller_than_a_shared_prefix_hits_only_retained_blocks(tiny_engine_factory):
    """vLLM #5537: sliding window + prefix caching with a window smaller than the shared
    prefix: no crash, hits only on blocks before the first dropped token, output equal to a
    run without the cache."""
    cached = tiny_engine_factory(block_size=4, num_blocks=64)
    cached.add_request("a", SHARED + [9], params(20, SINKS))
    first = drain(cached)["a"]
    cached.add_request("b", SHARED + [9], params(20, SINKS))
    second = drain(cached)["b"]
    plain = tiny_engine_factory(block_size=4, num_blocks=64, enable_prefix_caching=False)
    plain.add_request("c", SHARED + [9], params(20, SINKS))
    alone = drain(plain)["c"]
    spec = RetentionSpec.from_dict(SINKS)
    assert first.token_ids == second.token_ids == alone.token_ids
    assert second.metrics.num_cached_tokens == (spec.sinks + spec.window) // 4 * 4 == 8


def test_full_request_hits_blocks_a_policy_request_hashed(tiny_engine_factory):
    """Blocks hashed by an evicting request hold what full retention computes: a full request
    hitting them gives the tokens of a run without the cache."""
    engine = tiny_engine_factory(block_size=4, num_blocks=64)
    engine.add_request("a", SHARED, params(5, SINKS))
    drain(engine)
    engine.add_request("b", SHARED[:12] + [17, 18, 19], params(10))
    hit = drain(engine)["b"]
    plain = tiny_engine_factory(block_size=4, num_blocks=64, enable_prefix_caching=False)
    plain.add_request("c", SHARED[:12] + [17, 18, 19], params(10))
    assert hit.metrics.num_cached_tokens == 8 and hit.token_ids == drain(plain)["c"].token_ids


def test_a_policy_never_alters_a_block_another_sequence_holds(tiny_engine_factory):
    """An h2o request that hit a full request's prefix blocks compacts its KV; the blocks the
    full request holds keep their bytes and its tokens equal its run alone."""
    engine = tiny_engine_factory(block_size=4, num_blocks=96, max_num_seqs=2)
    h2o = {"policy": "h2o", "budget": 12, "window": 4, "sinks": 1}
    engine.add_request("full", SHARED + [5], params(40))
    engine.step()  # the full request's prompt is in the cache and held
    full_req = engine.scheduler.requests["full"]
    held_blocks = list(full_req.block_table[:10])
    before = [t[held_blocks].clone() for t in engine.store.key_blocks]
    engine.add_request("h2o", SHARED + [6], params(40, h2o))
    outs = drain(engine, check=lambda e: [
        torch.testing.assert_close(t[held_blocks], b, atol=0, rtol=0)
        for t, b in zip(e.store.key_blocks, before)] if "full" in e.scheduler.requests else None)
    alone = tiny_engine_factory(block_size=4, num_blocks=96)
    alone.add_request("full", SHARED + [5], params(40))
    assert outs["full"].token_ids == drain(alone)["full"].token_ids
    assert outs["h2o"].metrics.num_cached_tokens > 0  # it did share the full request's blocks


def test_positions_are_logical_not_the_windowed_store_length(tiny_engine_factory):
    """transformers PR #38156: the sequence length is the logical one, never the number of
    slots a windowed store holds; positions keep counting while the KV stays bounded."""
    engine = tiny_engine_factory(block_size=4, num_blocks=64)
    seen = []

    def check(e):
        for req in e.scheduler.running:
            seen.append((req.num_computed_tokens, req.retention.num_held, req.num_kv_slots))

    engine.add_request("r", SHARED, params(60, SINKS))
    drain(engine, check)
    computed, held, slots = seen[-1]
    assert computed == 40 + 58 and held == 9 and slots < 16


def test_sinks_filling_capacity_is_refused_and_a_tiny_window_never_loops(tiny_engine_factory):
    """llama.cpp #3969 (context shift with n_keep >= n_ctx looped forever): a budget the sinks
    fill is refused; sinks with a window of one token still generate exactly what was asked."""
    engine = tiny_engine_factory(block_size=4, num_blocks=32)
    with pytest.raises(InvalidParameterError, match="no room for heavy hitters"):
        engine.add_request("bad", [3, 4, 5], params(5, {"policy": "h2o", "budget": 8,
                                                        "sinks": 8, "window": 1}))
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", SHARED, params(200, {"policy": "sinks", "window": 1, "sinks": 8}))
    assert len(drain(engine)["ok"].token_ids) == 200


def test_positions_after_a_partial_reuse(tiny_llama, tiny_engine_factory):
    """llama.cpp #12161: after a partial prefix reuse the next tokens get the positions after
    the reused ones: a sinks request that hit 2 blocks gives the mask-only reference's tokens
    and logprobs."""
    from retention_reference import mask_only_logprobs

    _, hf = tiny_llama
    engine = tiny_engine_factory(block_size=4, num_blocks=64)
    engine.add_request("warm", SHARED[:9], params(1))
    drain(engine)
    engine.add_request("r", SHARED, params(20, SINKS, logprobs=0))
    out = drain(engine)["r"]
    assert out.metrics.num_cached_tokens == 8
    ref = mask_only_logprobs(hf, (SHARED + out.token_ids)[:-1], RetentionSpec.from_dict(SINKS))
    for i, lp in enumerate(out.logprobs):
        row = ref[len(SHARED) - 1 + i]
        assert lp.token_id == int(row.argmax())
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4


@pytest.mark.parametrize("prompt", [[5], [5, 6]])
@pytest.mark.parametrize("policy", [{"policy": "h2o", "budget": 64},
                                    {"policy": "snapkv", "budget": 64}])
def test_a_budget_above_a_tiny_context_keeps_the_cache(tiny_engine_factory, prompt, policy):
    """kvpress PR #264: a budget larger than a 1- or 2-token context must not empty the
    cache: the run equals full retention's."""
    engine = tiny_engine_factory(block_size=4, num_blocks=32)
    engine.add_request("p", prompt, params(12, policy))
    engine.add_request("f", prompt, params(12))
    outs = drain(engine)
    assert outs["p"].token_ids == outs["f"].token_ids


def test_two_compressions_in_a_row_keep_the_budget():
    """kvpress #146: compressing an already compressed prompt again keeps the right total."""
    from kvledger.engine.retention.policies import make_policy
    from kvledger.engine.retention.state import RetainedKV

    spec = RetentionSpec("snapkv", budget=10, snapkv_window=4, snapkv_kernel=3)
    state = RetainedKV(make_policy(spec), block_size=4)
    state.append(0, 30)
    state.scores = torch.rand(30)
    state.evict(30, 30)
    assert state.num_held == 10
    state.evict(30, 30)
    state.append(30, 1)
    state.evict(31, 30)
    assert state.num_held == 11  # snapkv decodes keeping everything after its compression
    kept = state.pos[state.pos >= 0]
    assert set(range(26, 31)) <= set(kept.tolist())  # the observation window and the new one


def test_bounded_policy_admits_what_full_retention_cannot(tiny_engine_factory):
    """The scheduler admits by the bounded figure: 21 + 400 tokens never fit 24 blocks of 4
    under full retention, but do under sinks (2 + 8 kept, one 64-token chunk: 21 blocks); the same request with full is
    refused before it runs, and other requests are served."""
    engine = tiny_engine_factory(block_size=4, num_blocks=24)
    with pytest.raises(KVBudgetError, match="blocks"):
        engine.add_request("full", SHARED[:21], params(400))
    engine.add_request("sinks", SHARED[:21], params(400, SINKS))
    engine.add_request("short", [3, 4], params(4))
    outs = drain(engine)
    assert len(outs["sinks"].token_ids) == 400 and len(outs["short"].token_ids) == 4


def test_no_kv_cache_refuses_an_evicting_policy(tiny_engine_factory):
    engine = tiny_engine_factory(use_kv_cache=False)
    with pytest.raises(InvalidParameterError, match="needs the KV cache"):
        engine.add_request("r", [3, 4], params(3, SINKS))


@pytest.mark.slow
def test_sinks_kv_stays_bounded_over_5000_tokens(tiny_engine_factory):
    """5,000 generated tokens under sinks, past the model's 512-position context: the blocks
    held, counted at every step, never pass the policy's bound; all free at idle."""
    spec = RetentionSpec("sinks", window=32, sinks=4)
    engine = tiny_engine_factory(block_size=4, num_blocks=40, attention="paged-native")
    bound = spec.max_kv_blocks(40, 5040, 4)
    peaks = []

    def check(e):
        for req in e.scheduler.running:
            peaks.append(len(req.block_table))
            assert req.peak_num_blocks <= bound

    engine.add_request("long", SHARED, params(5000, spec))
    out = drain(engine, check)
    assert len(out["long"].token_ids) == 5000
    assert max(peaks) <= bound < 5040 // 4
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.pool.num_blocks
