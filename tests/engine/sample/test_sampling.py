"""Sampler: greedy, top-k, top-p, temperature and seeds against hand-computed distributions."""

from __future__ import annotations

import math

import torch

from kvledger.engine.request import Request
from kvledger.engine.sample.sampler import Sampler
from kvledger.engine.sample.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 3.0])  # softmax: 0.229 0.084 0.051 0.011 0.624


def _draw(params: SamplingParams, n: int, logits=LOGITS) -> list[int]:
    sampler, req = Sampler(), Request("r", [1], params)  # one request: one seeded generator
    return [sampler.sample(logits[None], [req])[0][0] for _ in range(n)]


def test_greedy_is_argmax():
    assert _draw(SamplingParams(temperature=0.0), 3) == [4, 4, 4]


def test_top_k_one_is_greedy_and_top_k_two_keeps_two():
    assert set(_draw(SamplingParams(temperature=1.0, top_k=1, seed=0), 50)) == {4}
    assert set(_draw(SamplingParams(temperature=5.0, top_k=2, seed=0), 200)) == {0, 4}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)  # token 4: 0.624, token 0: 0.229, then 0.084 ...
    assert probs[4] < 0.7 < probs[4] + probs[0]
    assert set(_draw(SamplingParams(temperature=1.0, top_p=0.7, seed=1), 300)) == {0, 4}
    assert set(_draw(SamplingParams(temperature=1.0, top_p=0.5, seed=1), 100)) == {4}


def test_seed_reproduces_and_frequencies_follow_softmax():
    params = SamplingParams(temperature=1.0, seed=123)
    first, second = _draw(params, 4000), _draw(params, 4000)
    assert first == second
    expected = [math.exp(x) / sum(math.exp(y) for y in LOGITS.tolist()) for x in LOGITS.tolist()]
    for token, p in enumerate(expected):
        freq = first.count(token) / len(first)
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / len(first)) + 1e-3


def test_logprobs_are_the_raw_log_softmax_with_top_alternatives():
    sampler = Sampler()
    _, lps = sampler.sample(LOGITS[None], [Request("r", [1], SamplingParams(temperature=0.0,
                                                                             logprobs=2))])
    lp = lps[0]
    log_z = math.log(sum(math.exp(x) for x in LOGITS.tolist()))
    assert lp.token_id == 4
    assert abs(lp.logprob - (3.0 - log_z)) < 1e-6
    assert [t for t, _ in lp.top] == [4, 0]
    assert abs(lp.top[1][1] - (2.0 - log_z)) < 1e-6


def test_degenerate_distribution_falls_back_to_greedy():
    huge = torch.tensor([1e38, -1e38, 3e38, 0.0])
    assert _draw(SamplingParams(temperature=1e-30, seed=0), 2, huge) == [2, 2]
    assert _draw(SamplingParams(temperature=1.0, top_p=1e-300, seed=0), 2) == [4, 4]
