"""fp32 greedy with speculation emits the tokens plain decoding emits (the issue's oracle):
every method, several batch sizes, prefix-cache hits, preemption, quantized KV (sliding
layers: tests/model/test_family_speculative.py); the pool is whole at idle and every step
holds what the ledger prices."""

from __future__ import annotations

import random

import pytest
from spec_kit import NGRAM, SUFFIX, assert_idle_whole, run, tokens

from kvledger.engine.sample.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _prompts(n: int, length: int = 24, shared: int = 0, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 320) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 320) for _ in range(length - shared + i)]
            for i in range(n)]


@pytest.mark.parametrize("method", [NGRAM, SUFFIX, {"method": "auto"}])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_greedy_tokens_equal_plain(tiny_engine_factory, method, batch):
    prompts = _prompts(batch)
    plain = tokens(run(tiny_engine_factory(), prompts, GREEDY))
    engine = tiny_engine_factory(speculative_config=method)
    assert tokens(run(engine, prompts, GREEDY)) == plain
    assert_idle_whole(engine)
    if method["method"] != "auto":  # the gate may decline every proposal
        s = engine.stats()
        assert s["spec_accepted_tokens"] > 0  # the random model loops: proposals hit
        assert s["spec_proposed_tokens"] > s["spec_accepted_tokens"]  # and some miss


def test_prefix_hits_and_preemption(tiny_engine_factory):
    """Shared prefixes hit the cache; a pool of 12 blocks preempts; both with proposals."""
    prompts = _prompts(8, length=40, shared=32)
    plain = tokens(run(tiny_engine_factory(), prompts, GREEDY))
    engine = tiny_engine_factory(num_blocks=14, speculative_config=NGRAM)
    assert tokens(run(engine, prompts, GREEDY)) == plain
    s = engine.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hit_tokens"] > 0
    assert s["spec_accepted_tokens"] > 0
    assert_idle_whole(engine)


def test_cache_holds_only_accepted_tokens(tiny_engine_factory):
    """After a run with many rejections, a second run of the same prompts hits the blocks the
    first cached and still emits the plain tokens (a block hashed with a rejected proposal's
    K/V would change them)."""
    prompts = _prompts(4, length=20)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain = tokens(run(tiny_engine_factory(), prompts, params))
    engine = tiny_engine_factory(speculative_config=NGRAM)
    first = run(engine, prompts, params)
    again = [p + o.token_ids[:-1] for p, o in zip(prompts, first)]
    continued = tokens(run(tiny_engine_factory(), again, SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True)))
    for p, o in zip(again, first):
        engine.add_request("x" + str(len(p)), p, SamplingParams(
            max_tokens=1, temperature=0.0, ignore_eos=True))
    hits = []
    while engine.has_unfinished_requests():
        hits += [o for o in engine.step() if o.finished]
    assert tokens(first) == plain
    assert sorted(tokens(hits)) == sorted(continued)
    assert sum(o.metrics.num_cached_tokens for o in hits) > 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_quantized_kv(tiny_engine_factory, kv_cache_dtype):
    """Quantized KV: speculation seals no block holding a proposal, so the codes, and the
    tokens, are those of plain decoding."""
    prompts = _prompts(4)
    plain = tokens(run(tiny_engine_factory(kv_cache_dtype=kv_cache_dtype), prompts, GREEDY))
    engine = tiny_engine_factory(kv_cache_dtype=kv_cache_dtype, speculative_config=NGRAM)
    assert tokens(run(engine, prompts, GREEDY)) == plain
    assert engine.stats()["spec_accepted_tokens"] > 0
    assert_idle_whole(engine)


def test_stop_and_logprobs_of_emitted_tokens(tiny_engine_factory):
    """max_tokens, stop token ids and logprobs hold token by token inside a verify."""
    prompts = _prompts(4)
    params = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True, logprobs=2,
                            stop_token_ids=[7])
    plain = run(tiny_engine_factory(), prompts, params)
    spec = run(tiny_engine_factory(speculative_config=NGRAM), prompts, params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert [lp.token_id for lp in b.logprobs] == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_request_metrics_count_acceptance(tiny_engine_factory):
    engine = tiny_engine_factory(speculative_config=NGRAM)
    outs = run(engine, _prompts(3), GREEDY)
    s = engine.stats()
    assert sum(o.metrics.spec_proposed_tokens for o in outs) == s["spec_proposed_tokens"]
    assert sum(o.metrics.spec_accepted_tokens for o in outs) == s["spec_accepted_tokens"]
    assert s["spec_proposed_tokens_ngram"] == s["spec_proposed_tokens"]
