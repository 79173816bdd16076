"""Batched logit bias, penalties and min-p against independent references: transformers'
RepetitionPenaltyLogitsProcessor and MinPLogitsWarper, and OpenAI's documented formula for
presence / frequency penalties computed row by row in plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from kvledger.engine.sample.penalties import apply_min_p, apply_penalties
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError

VOCAB = 50


def _rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, VOCAB, generator=g) * 3
    prompts = [[1, 2, 3, 3], [4, 5], [7], [8, 9, 10]]
    outputs = [[3, 3, 11, 12, 11, 11], [5, 6], [], [40, 41, 40]]
    return logits, prompts, outputs


def test_presence_and_frequency_follow_openais_formula():
    logits, prompts, outputs = _rows()
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(presence_penalty=-1.0),
              SamplingParams(frequency_penalty=2.0),  # no output yet: unchanged
              SamplingParams()]
    got = apply_penalties(logits, params, prompts, outputs)
    for i, p in enumerate(params):
        for t in range(VOCAB):
            c = outputs[i].count(t)  # mu[j] - c[j] * a_freq - (c[j] > 0) * a_pres
            want = float(logits[i, t]) - c * p.frequency_penalty - (c > 0) * p.presence_penalty
            assert float(got[i, t]) == pytest.approx(want, abs=1e-5), (i, t)


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits, prompts, outputs = _rows(1)
    params = [SamplingParams(repetition_penalty=r) for r in (1.3, 0.7, 2.0, 1.0)]
    got = apply_penalties(logits, params, prompts, outputs)
    for i, p in enumerate(params):
        ids = torch.tensor([prompts[i] + outputs[i]])
        want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[i:i + 1].clone())
        torch.testing.assert_close(got[i], want[0])


def test_logit_bias_adds_to_the_listed_tokens_only():
    logits, prompts, outputs = _rows(2)
    params = [SamplingParams(logit_bias={28: 100.0, 3: -5.5}), SamplingParams(),
              SamplingParams(logit_bias={0: 1.0}), SamplingParams()]
    got = apply_penalties(logits, params, prompts, outputs)
    want = logits.clone()
    want[0, 28] += 100.0
    want[0, 3] -= 5.5
    want[2, 0] += 1.0
    torch.testing.assert_close(got, want)
    assert int(torch.argmax(got[0])) == 28  # {"28": 100} forces token 28 under greedy


def test_neutral_rows_are_untouched_and_no_copy_without_work():
    logits, prompts, outputs = _rows(3)
    assert apply_penalties(logits, [SamplingParams()] * 4, prompts, outputs) is logits
    params = [SamplingParams(repetition_penalty=1.5)] + [SamplingParams()] * 3
    got = apply_penalties(logits, params, prompts, outputs)
    assert torch.equal(got[1:], logits[1:])


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_matches_transformers(min_p):
    from transformers import MinPLogitsWarper

    logits, _, _ = _rows(4)
    probs = torch.softmax(logits, dim=-1)
    got = apply_min_p(probs, min_p)
    if min_p == 0.0:
        assert got is probs
        return
    kept = MinPLogitsWarper(min_p)(None, logits.clone()) > -math.inf
    assert torch.equal(got > 0, kept)


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 2.5}, {"frequency_penalty": -2.01}, {"repetition_penalty": 0},
    {"repetition_penalty": float("inf")}, {"min_p": 1.5}, {"min_p": float("nan")},
    {"logit_bias": {1: 101}}, {"logit_bias": {-1: 1}}, {"logit_bias": {"1": 1}},
    {"logit_bias": [1]}, {"logit_bias": {1: float("nan")}},
    {"max_tokens": 3.5}, {"max_tokens": True}, {"temperature": "0.5"}, {"stop": 5},
    {"stop": [""]}, {"stop": ["a", 3]}, {"top_k": 2.0}, {"seed": 1.5}, {"logprobs": True},
    {"ignore_eos": "yes"}, {"stop_token_ids": [-1]},
])
def test_bad_values_are_refused_at_construction(kwargs):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kwargs)


def test_vocabulary_check_names_the_field():
    with pytest.raises(InvalidParameterError, match="logit_bias has token id 50"):
        SamplingParams(logit_bias={50: 1.0}).check_vocab(VOCAB)
    SamplingParams(logit_bias={49: 1.0}).check_vocab(VOCAB)


def test_the_sampler_applies_them_in_one_batch_and_returns_raw_logprobs():
    from kvledger.engine.request import Request
    from kvledger.engine.sample.sampler import Sampler

    logits, prompts, outputs = _rows(5)
    params = [SamplingParams(temperature=0, logit_bias={28: 100.0}, logprobs=0),
              SamplingParams(temperature=0, repetition_penalty=50.0),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0)]
    reqs = []
    for i, p in enumerate(params):
        req = Request(f"r{i}", prompts[i], p)
        req.output_token_ids.extend(outputs[i])
        reqs.append(req)
    tokens, lps = Sampler().sample(logits, reqs)
    want = apply_penalties(logits, params, prompts, outputs).argmax(dim=-1).tolist()
    assert tokens == want and tokens[0] == 28
    assert tokens[2] == int(logits[2].argmax())  # a neutral row: plain greedy
    # logprobs are the model's raw distribution (vLLM's default), not the biased one
    assert lps[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[28]))


def test_min_p_one_keeps_only_the_top_token_when_sampling():
    from kvledger.engine.request import Request
    from kvledger.engine.sample.sampler import Sampler

    logits, _, _ = _rows(6)
    req = Request("r", [1], SamplingParams(temperature=2.0, min_p=1.0, seed=0))
    draws = {Sampler().sample(logits[:1], [req])[0][0] for _ in range(30)}
    assert draws == {int(logits[0].argmax())}


def _tiny_llm(tiny_engine_factory):
    import itertools

    from kvledger.engine.llm import LLM

    llm = LLM.__new__(LLM)  # an LLM over the tiny engine, without loading a model
    llm.engine, llm.tokenizer, llm._counter = tiny_engine_factory(), None, itertools.count()
    return llm


def test_logit_bias_forces_the_token_end_to_end(tiny_engine_factory):
    llm = _tiny_llm(tiny_engine_factory)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0,
                                                   logit_bias={28: 100.0}, ignore_eos=True))
    assert out[0].token_ids == [28] * 4


@pytest.mark.parametrize("bad, match", [
    ({"logit_bias": {10_000: 1.0}}, "outside the vocabulary"),
    ({"stop_token_ids": [320]}, "outside the vocabulary"),
])
def test_out_of_vocabulary_ids_are_refused_and_leave_nothing(tiny_engine_factory, bad, match):
    llm = _tiny_llm(tiny_engine_factory)
    with pytest.raises(InvalidParameterError, match=match):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, **bad))
    assert not llm.engine.has_unfinished_requests()


def test_bad_arguments_leave_the_llm_usable(tiny_engine_factory):
    # issue 14: SamplingParams(stop=5) used to raise a bare TypeError after the request was
    # registered, and every later generate failed with KeyError
    llm = _tiny_llm(tiny_engine_factory)
    with pytest.raises(InvalidParameterError, match="stop"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, stop=5))
    params = SamplingParams(max_tokens=2)
    params.stop = 5  # changed after construction: checked again on add
    with pytest.raises(InvalidParameterError, match="stop"):
        llm.generate([[5, 6]], params)
    with pytest.raises(InvalidParameterError, match="SamplingParams"):
        llm.generate([[5, 6]], {"max_tokens": 2})
    with pytest.raises(InvalidParameterError, match="2 prompts but 3"):
        llm.generate([[5, 6], [7, 8]], [SamplingParams(max_tokens=2)] * 3)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2, temperature=0))[0]
               .token_ids) == 2
