"""Prompt log-probabilities (kvledger.engine.sample.prompt_logprobs) against transformers on the
same weights (fp32): entry i is log_softmax(HF logits at position i - 1)[token i], entry 0 None,
whatever the chunking, batching, prefix cache or preemption. The bundled model's check against
the GGUF loaded by transformers is marked slow."""

from __future__ import annotations

import random

import pytest
import torch

from kvledger.engine.sample.sampling_params import SamplingParams

TOL = 1e-4


def _prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def _oracle(hf_model, prompt: list[int]) -> torch.Tensor:
    """log-softmax [P, vocab] of transformers' logits at every prompt position (fp32)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _run(engine, prompts: dict[str, list[int]], params: dict[str, SamplingParams]) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params[rid])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _check(entries, prompt, oracle, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        row = oracle[i - 1]
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - float(row[prompt[i]])) < TOL
        value = row[prompt[i]]  # rank: 1 + tokens more likely, up to ties within TOL
        assert int((row > value + TOL).sum()) < entry.rank <= int((row > value - TOL).sum()) + 1
        ref = torch.topk(row, k)
        assert [t for t, _ in entry.top] == ref.indices.tolist()
        assert all(abs(v - r) < TOL for (_, v), r in zip(entry.top, ref.values.tolist()))


def test_prompt_logprobs_match_transformers_chunked_and_batched(tiny_engine_factory, tiny_llama):
    _, hf_model = tiny_llama
    prompt = _prompt(70)
    oracle = _oracle(hf_model, prompt)
    wanted = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    alone = _run(tiny_engine_factory(), {"p": _prompt(30, 2)}, {"p": plain})["p"].token_ids
    for budget in (2048, 24):  # whole prompt in one step, then chunks of 24 tokens
        engine = tiny_engine_factory(max_num_batched_tokens=budget)
        done = _run(engine, {"w": prompt, "p": _prompt(30, 2)}, {"w": wanted, "p": plain})
        _check(done["w"].prompt_logprobs, prompt, oracle, k=2)
        assert done["p"].token_ids == alone and done["p"].prompt_logprobs is None
        # the sampled tokens are the model's own greedy continuation
        full = prompt + done["w"].token_ids
        assert done["w"].token_ids[0] == int(_oracle(hf_model, full)[len(prompt) - 1].argmax())


def test_prompt_rows_become_logits_a_slice_at_a_time(tiny_engine_factory, tiny_llama,
                                                      monkeypatch):
    """A 300-token prompt in one chunk never has more than SLICE_ROWS rows of logits at once
    (issue 61: the whole [tokens, vocab] block held 1.7 GB), and the entries across slice
    borders, the other request's tokens, are unchanged."""
    from kvledger.engine.sample import prompt_logprobs

    monkeypatch.setattr(prompt_logprobs, "SLICE_ROWS", 32)
    _, hf_model = tiny_llama
    prompt = _prompt(300, 5)
    engine = tiny_engine_factory()
    sizes = []
    compute = engine.model.compute_logits
    monkeypatch.setattr(engine.model, "compute_logits",
                        lambda hidden: sizes.append(len(hidden)) or compute(hidden))
    wanted = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    done = _run(engine, {"w": prompt, "p": _prompt(20, 6)}, {"w": wanted, "p": plain})
    assert max(sizes) <= 32 and sum(sizes) > 300
    _check(done["w"].prompt_logprobs, prompt, _oracle(hf_model, prompt), k=3)
    alone = _run(tiny_engine_factory(), {"p": _prompt(20, 6)}, {"p": plain})["p"].token_ids
    assert done["p"].token_ids == alone


def test_a_cached_prompt_is_computed_again_for_its_logprobs(tiny_engine_factory, tiny_llama):
    _, hf_model = tiny_llama
    prompt = _prompt(50, 3)
    engine = tiny_engine_factory()
    _run(engine, {"a": prompt}, {"a": SamplingParams(max_tokens=2, temperature=0.0)})
    wanted = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    out = _run(engine, {"b": prompt}, {"b": wanted})["b"]
    assert out.metrics.num_cached_tokens == 0
    _check(out.prompt_logprobs, prompt, _oracle(hf_model, prompt), k=0)
    again = _run(engine, {"c": prompt}, {"c": SamplingParams(max_tokens=2, temperature=0.0)})
    assert again["c"].metrics.num_cached_tokens == 48  # b's blocks entered the cache


def test_preempted_requests_record_each_entry_once(tiny_engine_factory, tiny_llama):
    _, hf_model = tiny_llama
    prompts = {f"r{i}": _prompt(40 + i, 10 + i) for i in range(6)}
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    engine = tiny_engine_factory(num_blocks=12)  # each request needs up to 6 blocks
    done = _run(engine, prompts, dict.fromkeys(prompts, params))
    assert engine.stats()["num_preemptions"] > 0
    big = _run(tiny_engine_factory(), prompts, dict.fromkeys(prompts, params))
    for rid, prompt in prompts.items():
        _check(done[rid].prompt_logprobs, prompt, _oracle(hf_model, prompt), k=1)
        assert done[rid].token_ids == big[rid].token_ids


@pytest.mark.slow
def test_bundled_model_prompt_logprobs_match_transformers(bundled_path, hf_oracle):
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(bundled_path), dtype="fp32"))
    prompt = engine.tokenize("The capital of France is Paris. The capital of Italy is Rome.")
    out = _run(engine, {"q": prompt},
               {"q": SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=5)})["q"]
    _check(out.prompt_logprobs, prompt, _oracle(hf_oracle, prompt), k=5)


@pytest.mark.slow
def test_tensor_parallel_prompt_logprobs_equal_one_process(tiny_llama_folder):
    """TP = 2 gathers the vocabulary-split logits of every prompt row: the same entries."""
    from tp_harness import tp_engine

    folder = tiny_llama_folder(heads=4, kv_heads=2, vocab=322)
    prompt = _prompt(45, 4)
    params = {"q": SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)}
    runs = []
    for size in (1, 2):
        engine = tp_engine(folder, size, max_num_batched_tokens=16)
        runs.append(_run(engine, {"q": prompt}, params)["q"])
        engine.close()
    one, two = (r.prompt_logprobs for r in runs)
    assert len(one) == len(two) == len(prompt) and one[0] is two[0] is None
    for a, b in zip(one[1:], two[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < TOL
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert runs[0].token_ids == runs[1].token_ids
