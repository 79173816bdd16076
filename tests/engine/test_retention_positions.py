"""Positions after eviction (``kv_positions``): ``cache`` (StreamingLLM's scheme, the held
tokens at 0..n-1 in slot order, the query at n) against ``original`` (each key where it was
computed). Oracle for ``cache``: transformers on the same weights with a cache rebuilt at every
step from the held tokens' raw (never rotated) keys, rotated by transformers' RoPE to positions
0..m-1, and the step's queries at m.. (``retention_reference.cache_position_logprobs``), fed
in the engine's own steps; streaming past the tiny model's 512 positions. Tiny random Llama,
fp32, 1e-4."""

from __future__ import annotations

import functools

import pytest
import torch
from retention_reference import cache_position_logprobs, mask_only_logprobs
from retention_run import run

from kvledger.engine.retention.state import RetainedKV
from kvledger.ledger.retention import RetentionSpec

PROMPT = [(13 * i + 7) % 300 + 3 for i in range(450)]  # prefilled in chunks of 64
SINKS = {"policy": "sinks", "window": 24, "sinks": 4}

generate = functools.partial(run, logprobs=0)  # every test here reads the logprobs


@pytest.fixture
def steps(monkeypatch):
    """(start, n) of every step an evicting request computes, as the engine ran it."""
    seen: list[tuple[int, int]] = []
    append = RetainedKV.append

    def recording(self, start, n):
        seen.append((start, n))
        return append(self, start, n)

    monkeypatch.setattr(RetainedKV, "append", recording)
    return seen


def _chosen(rows: torch.Tensor, out) -> torch.Tensor:
    """The reference's logprob of each generated token ([len(out.token_ids)])."""
    ids = torch.tensor(out.token_ids)
    return rows[len(out.prompt_token_ids) - 1:][torch.arange(len(ids)), ids]


def test_cache_positions_equal_the_streaming_reference(tiny_llama, tiny_engine_factory, steps):
    """450 + 70 tokens (past the 512 positions) under sinks 4 + 24 with cache positions, in a
    pool of exactly the policy's bound: every logprob equals the cache-position reference at
    1e-4, greedy tokens are its best; the original-position reference differs (the sinks sit
    hundreds of positions away there), so the comparison can fail; the stored sink keys are
    never rewritten (the rotation is applied to gathered copies)."""
    _, hf = tiny_llama
    spec = RetentionSpec.from_dict({**SINKS, "positions": "cache"})
    new = 70
    bound = spec.max_kv_blocks(len(PROMPT), len(PROMPT) + new, 4)
    engine = tiny_engine_factory(block_size=4, num_blocks=bound)
    sink_keys = []

    def check(engine):
        for req in engine.scheduler.running:
            assert len(req.block_table) <= bound
            assert req.retention.num_held <= spec.capacity - 1
            block = req.block_table[0]  # positions 0..3: the sinks
            keys = [k[block].clone() for k in engine.store.key_blocks]
            sink_keys.append(keys)
            assert all(torch.equal(a, b) for a, b in zip(keys, sink_keys[0]))

    out = generate(engine, PROMPT, new, spec.as_dict(), check)
    assert len(out.token_ids) == new and engine.scheduler.kv.pool.num_free == bound
    assert out.prompt_token_ids == PROMPT and len(PROMPT) + new > 512
    tokens = (PROMPT + out.token_ids)[:-1]
    ref = cache_position_logprobs(hf, tokens, spec, steps)
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    assert torch.isfinite(got).all()
    assert (got - _chosen(ref, out)).abs().max() < 1e-4
    best = ref[len(PROMPT) - 1:].max(-1).values
    assert (_chosen(ref, out) >= best - 1e-4).all()
    original = mask_only_logprobs(hf, tokens, spec)  # the sinks where they were computed
    assert (original - ref)[len(PROMPT) - 1:].abs().max() > 10 * 1e-4


def test_original_positions_equal_the_mask_only_reference(tiny_llama, tiny_engine_factory):
    """Original positions (the engine's behaviour before cache positions became the default):
    equal to the mask-only reference (same positions), and unlike cache positions once the
    sinks are far."""
    _, hf = tiny_llama
    engine = tiny_engine_factory(block_size=4, num_blocks=64)
    spec = RetentionSpec.from_dict({**SINKS, "positions": "original"})
    out = generate(engine, PROMPT[:120], 40, spec.as_dict())
    ref = mask_only_logprobs(hf, (PROMPT[:120] + out.token_ids)[:-1], spec)
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    ids = torch.tensor(out.token_ids)
    assert (got - ref[119:][torch.arange(len(ids)), ids]).abs().max() < 1e-4
    cache = generate(engine, PROMPT[:120], 40, {**SINKS, "positions": "cache"})
    assert [lp.logprob for lp in cache.logprobs] != [lp.logprob for lp in out.logprobs]


def test_window_cache_positions_change_nothing(tiny_engine_factory):
    """A window without sinks holds one contiguous run of tokens: every distance is the same
    in either scheme, so cache positions give exactly original positions' logprobs."""
    engine = tiny_engine_factory(block_size=4, num_blocks=64)
    a = generate(engine, PROMPT[:60], 40, {"policy": "window", "window": 12,
                                           "positions": "original"})
    b = generate(engine, PROMPT[:60], 40, {"policy": "window", "window": 12,
                                           "positions": "cache"})
    assert a.token_ids == b.token_ids  # logprobs to float rounding: RoPE of other angles
    got = torch.tensor([lp.logprob for lp in b.logprobs])
    assert (got - torch.tensor([lp.logprob for lp in a.logprobs])).abs().max() < 1e-5


def test_cache_positions_leave_the_prefix_cache_as_full_retention(tiny_engine_factory):
    """A sinks request with cache positions hashes only blocks it never turned (the rotation
    is never written): a full request on the same prompt after it, hitting those blocks,
    generates what it generates with no prefix cache."""
    prompt = PROMPT[:90]
    alone = generate(tiny_engine_factory(block_size=4, num_blocks=96,
                                         enable_prefix_caching=False), prompt, 12, None)
    engine = tiny_engine_factory(block_size=4, num_blocks=96)
    generate(engine, prompt, 30, {"policy": "sinks", "window": 12, "sinks": 4,
                                  "positions": "cache"})
    after = generate(engine, prompt, 12, None)
    assert after.metrics.num_cached_tokens > 0  # it did hit the sinks request's blocks
    assert after.token_ids == alone.token_ids
    assert [lp.logprob for lp in after.logprobs] == pytest.approx(
        [lp.logprob for lp in alone.logprobs], abs=1e-5)
