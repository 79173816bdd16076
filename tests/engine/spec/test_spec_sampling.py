"""Rejection sampling keeps the target distribution: over many seeded draws on the tiny model
with a deliberately bad proposal, and with the model as its own draft (``draft_model``: it
proposes its argmax, accepted about as often as rejected at this temperature), the emitted
(first, second) token pairs match transformers' distribution (chi-squared); seeded runs repeat
exactly."""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.model.weights.loader import load_weights

PROMPT = [5, 17, 42, 99, 7, 123, 64, 8]
TOP_K, TEMPERATURE, DRAWS = 3, 1.3, 2400
CHI2_CRITICAL = 26.12  # chi-squared quantile 0.999 at 8 degrees of freedom (9 cells - 1)


def _top(hf, ids: list[int]) -> dict[int, float]:
    """transformers' next-token distribution after ``ids`` under top-k and temperature."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].double() / TEMPERATURE
    top = torch.topk(logits, TOP_K)
    probs = torch.softmax(top.values, dim=-1)
    return dict(zip(top.indices.tolist(), probs.tolist()))


@pytest.fixture(scope="module")
def oracle(tiny_llama):
    """(folder, spec, weights, {(t1, t2): probability}, the bad proposal after each t1: the
    least likely token of its top 3)."""
    folder, hf = tiny_llama
    first = _top(hf, PROMPT)
    joint, bad = {}, {}
    for t1, p1 in first.items():
        second = _top(hf, PROMPT + [t1])
        bad[t1] = min(second, key=second.get)
        joint.update({(t1, t2): p1 * p2 for t2, p2 in second.items()})
    spec, weights = load_weights(folder, torch.float32)
    return folder, spec, weights, joint, bad


def _draws(oracle, seeds, draft: bool = False) -> tuple[list[tuple[int, int]], dict]:
    """Emitted pairs of ``seeds``' runs: the bad proposal after the first token, or (with
    ``draft``) the model as its own draft model proposing one token per step."""
    folder, spec, weights, _, bad = oracle
    config = ({"method": "draft_model", "model": str(folder), "num_speculative_tokens": 1,
               "gate": False} if draft else {"method": "ngram", "gate": False})
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="fp32", attention="paged-native",
                                    speculative_config=config), spec=spec, weights=weights)

    def propose(tokens, k):  # after the first output token: its bad second token
        return ([bad[tokens[-1]]], "ngram") if len(tokens) == len(PROMPT) + 1 else ([], "ngram")

    if not draft:
        engine.speculator.proposer.propose = propose
    for s in seeds:
        engine.add_request(f"r{s}", PROMPT, SamplingParams(
            max_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, seed=s, ignore_eos=True))
    pairs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                pairs[out.request_id] = tuple(out.token_ids[:2])
    return [pairs[f"r{s}"] for s in seeds], engine.stats()


@pytest.mark.parametrize("draft", [False, True], ids=["bad-proposal", "draft-model"])
def test_emitted_pairs_follow_the_target_distribution(oracle, draft):
    joint = oracle[3]
    pairs, stats = _draws(oracle, range(DRAWS), draft)
    assert stats["spec_proposed_tokens"] == DRAWS  # every second token was a verify
    if draft:  # the argmax of a top-3 distribution: accepted at p(argmax), about half
        assert DRAWS / 4 < stats["spec_accepted_tokens"] < 3 * DRAWS / 4
        assert stats["draft_kv_blocks_free"] == stats["draft_kv_blocks_total"]
    else:  # the bad proposal mostly fails
        assert 0 < stats["spec_accepted_tokens"] < DRAWS / 3
    counts = {cell: 0 for cell in joint}
    for pair in pairs:
        counts[pair] += 1  # a pair outside the top-k support would raise here
    chi2 = sum((counts[c] - DRAWS * p) ** 2 / (DRAWS * p) for c, p in joint.items())
    assert chi2 < CHI2_CRITICAL, (chi2, counts)


@pytest.mark.parametrize("draft", [False, True], ids=["bad-proposal", "draft-model"])
def test_seeded_runs_repeat(oracle, draft):
    assert _draws(oracle, range(40), draft)[0] == _draws(oracle, range(40), draft)[0]
