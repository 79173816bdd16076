"""Scope ``prompt`` of window / sinks / h2o: the prompt compressed once, then every token kept
(kvpress's shape; tiny random Llama, fp32).

Oracles: transformers on the same weights with a 4-D mask that hides exactly the dropped
prompt keys from every query after the prompt and shows every later token (the mask-only
reference, same positions); transformers' own prefill attention probabilities (eager) for
which prompt tokens h2o keeps; the hand-computed sizes of ``ledger/retention.py`` for the KV
held; the run without the prefix cache for a warm run.
"""

from __future__ import annotations

import pytest
import torch
from retention_reference import (
    eager_attentions,
    held_masks,
    mask_only_logprobs,
    per_head_mask_logprobs,
    prompt_mask_logprobs,
)
from retention_run import recorder, run

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.ledger.retention import RetentionSpec

PROMPT = [(7 * i + 3) % 300 + 3 for i in range(21)]
SCOPED = {
    "window": {"policy": "window", "window": 6, "scope": "prompt"},
    "sinks": {"policy": "sinks", "window": 6, "sinks": 2, "scope": "prompt"},
    "h2o": {"policy": "h2o", "budget": 12, "window": 4, "sinks": 2, "scope": "prompt"},
}


def _assert_logprobs_equal(out, ref, prompt_len):
    for i, lp in enumerate(out.logprobs):
        row = ref[prompt_len - 1 + i]
        assert float(row[lp.token_id]) >= float(row.max()) - 1e-4, i  # greedy
        got = torch.tensor([lp.logprob] + [v for _, v in lp.top])
        want = row[[lp.token_id] + [t for t, _ in lp.top]]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["window", "sinks"])
@pytest.mark.parametrize("chunk", [2048, 5])
def test_prompt_scope_window_logits_equal_the_prompt_mask_reference(tiny_llama,
                                                                    tiny_engine_factory, name,
                                                                    chunk):
    """Every generated logprob equals transformers that hides the prompt's dropped keys (all
    but its first S and last W) from the queries after it and shows them every new token
    (1e-4); the reference differs from full attention and from scope ``always``."""
    _, hf = tiny_llama
    spec = RetentionSpec.from_dict(SCOPED[name])
    engine = tiny_engine_factory(block_size=4, num_blocks=64, max_num_batched_tokens=chunk)
    out = run(engine, PROMPT, 30, SCOPED[name], logprobs=3)
    tokens = PROMPT + out.token_ids
    p = len(PROMPT)
    kept = torch.zeros(p, dtype=torch.bool)
    kept[: spec.sinks] = True
    kept[p - spec.window:] = True
    ref = prompt_mask_logprobs(hf, tokens[:-1], p, kept)
    _assert_logprobs_equal(out, ref, p)
    full = torch.log_softmax(hf(torch.tensor([tokens[:-1]])).logits[0].float(), -1)
    always = mask_only_logprobs(hf, tokens[:-1], RetentionSpec(
        spec.policy, window=spec.window, sinks=spec.sinks if name == "sinks" else None,
        positions="original"))
    assert (full[-1] - ref[-1]).abs().max() > 1e-2
    assert (always[-1] - ref[-1]).abs().max() > 1e-2


def _prefill_votes(hf, select: str) -> torch.Tensor:
    """[rows, P] attention each prompt key received from every prompt query (transformers,
    eager), the query heads of a KV head summed (per head: row = layer * kv_heads + head);
    per sequence summed over everything ([1, P])."""
    attn = eager_attentions(hf, PROMPT)
    n, kv_heads = len(PROMPT), hf.config.num_key_value_heads
    votes = torch.stack([a[0].sum(1) for a in attn])  # [layers, heads, n]
    votes = votes.view(len(attn), kv_heads, -1, n).sum(2).reshape(-1, n)
    return votes.sum(0, keepdim=True) if select == "per-sequence" else votes


@pytest.mark.parametrize("select, scores", [("per-head", "sum"), ("per-sequence", "sum"),
                                            ("per-head", "mean")])
def test_prompt_scope_h2o_keeps_the_top_of_transformers_prefill_attention(sharp_llama,
                                                                         sharp_engine_factory,
                                                                         select, scores):
    """Which prompt tokens h2o in scope ``prompt`` keeps: the S sinks, the last W and, per
    (layer, KV head) or per sequence, the budget - S - W others with the most attention summed
    over every prompt query (transformers' own probabilities; ``mean``: divided by the P - i
    queries that see key i, as kvpress's ObservedAttentionPress does); then the run's logprobs
    equal the per-head mask reference of what each row held (1e-4), and heads chose
    differently."""
    _, hf = sharp_llama
    policy = {**SCOPED["h2o"], "select": select, "h2o_scores": scores}
    spec = RetentionSpec.from_dict(policy)
    n, s, w = len(PROMPT), spec.sinks, spec.window
    votes = _prefill_votes(hf, select)
    if scores == "mean":
        votes = votes / torch.arange(n, 0, -1)
    states = [(0, torch.zeros(6 if select == "per-head" else 1, 0, dtype=torch.int64))]
    engine = sharp_engine_factory(block_size=4, num_blocks=64, max_num_batched_tokens=9)
    out = run(engine, PROMPT, 20, policy, recorder(states), logprobs=2)
    pos = next(p for start, p in states if start > n)
    pos = pos.view(1, -1) if pos.dim() == 1 else pos
    protected = set(range(s)) | set(range(n - w, n))
    for r in range(len(votes)):
        kept = set(pos[r][(pos[r] >= 0) & (pos[r] < n)].tolist())
        assert len(kept) == spec.budget and protected <= kept, r
        heavy = sorted(kept - protected)
        others = sorted(set(range(n)) - kept)
        assert float(votes[r][heavy].min()) >= float(votes[r][others].max()) - 1e-5, r
    if scores == "mean":  # the ranking changed what was kept
        summed = _prefill_votes(hf, select)[:, s: n - w].topk(spec.budget - s - w).indices + s
        assert any(set(summed[r].tolist()) != set(p[(p >= s) & (p < n - w)].tolist())
                   for r, p in enumerate(pos))
    if select == "per-head":
        assert len({tuple(sorted(p[p < n].tolist())) for p in pos}) > 1
        tokens = PROMPT + out.token_ids
        held = [(start, p if p.dim() == 2 else p.view(1, -1).expand(6, -1))
                for start, p in states]
        ref = per_head_mask_logprobs(hf, tokens[:-1], held_masks(held, len(tokens) - 1, 3, 2))
        _assert_logprobs_equal(out, ref, n)


@pytest.mark.parametrize("name", sorted(SCOPED))
def test_prompt_scope_kv_grows_after_the_prompt_within_the_ledger_bound(tiny_engine_factory,
                                                                        name):
    """The whole prompt is held until it is in; then exactly ``prompt_keep`` of it, and every
    step adds its token (held = keep + computed - P), past the scope-``always`` capacity; the
    blocks stay within ``max_kv_blocks``; the pool's bytes equal the ledger's; all free at
    idle."""
    spec = RetentionSpec.from_dict(SCOPED[name])
    p, n_out = len(PROMPT), 40
    keep = spec.sinks + spec.window if name != "h2o" else spec.budget
    assert spec.prompt_keep == keep < p
    engine = tiny_engine_factory(block_size=4, num_blocks=64, max_num_batched_tokens=9)
    bound = spec.max_kv_blocks(p, p + n_out, 4)
    seen = []

    def check(e):
        for req in e.scheduler.running:
            done, held = req.num_computed_tokens, req.retention.num_held
            seen.append((done, held))
            assert held == (done if done < p else keep + done - p), (done, held)
            assert req.peak_num_blocks <= bound
            assert e.stats()["kv_bytes_predicted"] == held * e.bytes_per_token

    out = run(engine, PROMPT, n_out, SCOPED[name], check=check)
    assert len(out.token_ids) == n_out
    assert seen[-1] == (p + n_out - 2, keep + n_out - 2)  # before the last step
    always = RetentionSpec.from_dict({**SCOPED[name], "scope": "always"})
    assert seen[-1][1] > always.capacity - 1  # not bounded during decode
    assert any(done < p for done, _ in seen)  # the prompt came in chunks
    pool = engine.scheduler.kv.pool
    assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("name", sorted(SCOPED))
def test_a_prompt_within_the_budget_gives_full_tokens(tiny_engine_factory, name):
    full = run(tiny_engine_factory(block_size=4, num_blocks=64), PROMPT, 30)
    big = {**SCOPED[name], **({"budget": 40, "window": 20} if name == "h2o" else {"window": 21})}
    assert run(tiny_engine_factory(block_size=4, num_blocks=64), PROMPT, 30,
               big).token_ids == full.token_ids


SHARED = [(11 * i + 5) % 300 + 3 for i in range(40)]


@pytest.mark.parametrize("name, hits", [("sinks", 24), ("h2o", 0)])
def test_prefix_cache_warm_equals_cold(tiny_engine_factory, name, hits):
    """A prompt-scope request after a full one that hashed 6 blocks of its prompt: sinks takes
    the hit (the prompt is prefilled in full, so its blocks are full's) and h2o takes none (its
    scores need every prompt query); both outputs equal the run without the prefix cache, and
    the full request's blocks keep their bytes."""
    engine = tiny_engine_factory(block_size=4, num_blocks=96, max_num_seqs=2)
    engine.add_request("full", SHARED[:24] + [5], SamplingParams(max_tokens=30, temperature=0,
                                                                 ignore_eos=True))
    engine.step()
    blocks = list(engine.scheduler.requests["full"].block_table[:6])
    before = [t[blocks].clone() for t in engine.store.key_blocks]
    warm = run(engine, SHARED + [6], 20, SCOPED[name], lambda e: [
        torch.testing.assert_close(t[blocks], b, atol=0, rtol=0)
        for t, b in zip(e.store.key_blocks, before)] if "full" in e.scheduler.requests else None)
    assert warm.metrics.num_cached_tokens == hits
    cold = run(tiny_engine_factory(block_size=4, num_blocks=96, enable_prefix_caching=False),
               SHARED + [6], 20, SCOPED[name])
    assert warm.token_ids == cold.token_ids
