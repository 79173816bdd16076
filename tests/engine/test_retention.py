"""Retention policies in the paged engine (tiny random Llama, fp32).

Oracles: transformers on the same weights with a 4-D attention mask that keeps every key and
masks the dropped ones (the mask-only reference, same positions); the engine's own full
retention for policies that keep everything; the policy's bound from ``ledger/retention.py``
for the blocks held, counted at every step.
"""

from __future__ import annotations

import pytest
import torch
from retention_reference import mask_only_logprobs
from retention_run import run

from kvledger.ledger.retention import RetentionSpec

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(21)]

# one evicting spec per policy, small enough that the tiny run drops tokens
SMALL = {
    "window": {"policy": "window", "window": 8},
    "sinks": {"policy": "sinks", "window": 8, "sinks": 2, "positions": "original"},
    "h2o": {"policy": "h2o", "budget": 20, "window": 6, "sinks": 2},
    "snapkv": {"policy": "snapkv", "budget": 12, "snapkv_window": 4, "snapkv_kernel": 3},
}
# the same policies with sizes that keep every token of a 21 + 40 token run
LARGE = {
    "full": {"policy": "full"},
    "window": {"policy": "window", "window": 200},
    "sinks": {"policy": "sinks", "window": 200},
    "h2o": {"policy": "h2o", "budget": 300, "window": 100},
    "snapkv": {"policy": "snapkv", "budget": 100},
}


@pytest.mark.parametrize("name", ["window", "sinks"])
@pytest.mark.parametrize("chunk", [2048, 5])
def test_window_logits_equal_the_mask_only_reference(tiny_llama, tiny_engine_factory, name,
                                                     chunk):
    _, hf = tiny_llama
    spec = RetentionSpec.from_dict(SMALL[name])
    engine = tiny_engine_factory(block_size=4, num_blocks=64, max_num_batched_tokens=chunk)
    out = run(engine, PROMPT, 40, SMALL[name], logprobs=3)
    tokens = PROMPT + out.token_ids
    ref = mask_only_logprobs(hf, tokens[:-1], spec)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(PROMPT) - 1 + i]
        assert lp.token_id == int(row.argmax()), i
        got = torch.tensor([lp.logprob] + [v for _, v in lp.top])
        want = row[[lp.token_id] + [t for t, _ in lp.top]]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # the reference differs from full attention, so the test can tell the two apart
    full = torch.log_softmax(hf(torch.tensor([tokens[:-1]])).logits[0].float(), -1)
    assert (full[-1] - ref[-1]).abs().max() > 1e-2


@pytest.mark.parametrize("name", sorted(LARGE))
def test_a_policy_that_keeps_everything_gives_full_tokens(tiny_engine_factory, name):
    full = run(tiny_engine_factory(block_size=4, num_blocks=64), PROMPT, 40)
    kept = run(tiny_engine_factory(block_size=4, num_blocks=64), PROMPT, 40, LARGE[name])
    assert kept.token_ids == full.token_ids


@pytest.mark.parametrize("name", sorted(SMALL))
def test_policy_suite_bounds_held_kv_and_frees_everything(tiny_engine_factory, name):
    spec = RetentionSpec.from_dict(SMALL[name])
    engine = tiny_engine_factory(block_size=4, num_blocks=64, max_num_batched_tokens=9)
    n_out = 120
    bound = spec.max_kv_blocks(len(PROMPT), len(PROMPT) + n_out, 4)
    seen = []

    def check(e):
        for req in e.scheduler.running:
            state = req.retention
            assert req.peak_num_blocks <= bound
            assert state.num_slots <= len(req.block_table) * 4
            seen.append((req.num_computed_tokens, state.num_held))
            if spec.capacity is not None:
                assert state.num_held <= spec.capacity - 1
            for row in state.pos.view(-1, state.num_slots):  # per (layer, KV head) rows
                held = row[row >= 0]
                assert held.unique().numel() == held.numel() == state.num_held  # once each
                assert int(held.max()) == req.num_computed_tokens - 1  # the newest is kept

    out = run(engine, PROMPT, n_out, SMALL[name], check=check)
    assert len(out.token_ids) == n_out
    final_computed, final_held = seen[-1]
    assert final_held < final_computed  # it did drop tokens
    if spec.capacity is not None:  # kvpress #146: repeated eviction keeps the exact total
        assert final_held == spec.capacity - 1
    pool = engine.scheduler.kv.pool
    assert pool.num_free == pool.num_blocks
