"""Method ``draft_model``: fp32 greedy tokens equal plain decoding's with the model as its own
draft (every proposal accepted) and with a random draft of the same vocabulary (almost none);
the acceptance of a draft whose proposals the target's logit bias rejects equals the count of
a verify walk replayed on transformers (a draft whose KV kept a rejected token, or lost an
accepted one, would propose otherwise); the draft's pool holds exactly its computed tokens'
blocks at every step and is whole at idle; its bytes are counted where the pool is sized."""

from __future__ import annotations

import math
import random

import pytest
import torch
from spec_kit import assert_idle_whole, check_ledger, run, tokens

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _draft(folder, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": k,
            "gate": False}


def _prompts(n: int, length: int = 24, shared: int = 0, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 320) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 320) for _ in range(length - shared + i)]
            for i in range(n)]


def check_draft(engine) -> None:
    """The target's ledger (``spec_kit.check_ledger``), and every draft sequence holds the
    blocks of its computed tokens, short of its request's last token."""
    check_ledger(engine)
    drafter = engine.speculator.drafter
    drafter.pool.check_invariants()
    bs = engine.config.block_size
    for s in drafter.seqs.values():
        assert s.num_computed_tokens < s.target.num_tokens
        assert len(s.block_table) == math.ceil(s.num_computed_tokens / bs)


def _run(engine, prompts, params) -> list:
    """``spec_kit.run`` with :func:`check_draft` after every step; at the end both pools are
    whole."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        check_draft(engine)
    outs = [done[f"r{i}"] for i in range(len(prompts))]
    assert_idle_whole(engine)
    s = engine.stats()
    assert s["draft_kv_blocks_free"] == s["draft_kv_blocks_total"]
    assert not engine.speculator.drafter.seqs
    return outs


@pytest.mark.parametrize("batch", [1, 4])
def test_own_draft_accepts_every_proposal(tiny_engine_factory, tiny_llama, batch):
    prompts = _prompts(batch)
    plain = tokens(run(tiny_engine_factory(), prompts, GREEDY))
    engine = tiny_engine_factory(speculative_config=_draft(tiny_llama[0]))
    assert tokens(_run(engine, prompts, GREEDY)) == plain
    s = engine.stats()
    assert s["spec_proposed_tokens"] == s["spec_accepted_tokens"] > 0
    assert s["spec_proposed_tokens_draft_model"] == s["spec_proposed_tokens"]


@pytest.mark.parametrize("batch", [1, 4])
def test_random_draft_emits_the_target_tokens(tiny_engine_factory, tiny_llama_folder, batch):
    prompts = _prompts(batch)
    plain = tokens(run(tiny_engine_factory(), prompts, GREEDY))
    engine = tiny_engine_factory(speculative_config=_draft(tiny_llama_folder(seed=5)))
    assert tokens(_run(engine, prompts, GREEDY)) == plain
    s = engine.stats()
    assert s["spec_proposed_tokens"] > 10 * (s["spec_accepted_tokens"] + 1)  # a random guess


def test_prefix_hits_and_preemption(tiny_engine_factory, tiny_llama):
    """Shared prefixes hit the target's cache; a pool of 14 blocks preempts (the draft gives
    a preempted sequence's blocks back and computes it again when it runs again)."""
    prompts = _prompts(8, length=40, shared=32)
    plain = tokens(run(tiny_engine_factory(), prompts, GREEDY))
    engine = tiny_engine_factory(num_blocks=14, speculative_config=_draft(tiny_llama[0]))
    assert tokens(_run(engine, prompts, GREEDY)) == plain
    s = engine.stats()
    assert s["num_preemptions"] > 0 and s["prefix_cache_hit_tokens"] > 0
    assert s["spec_accepted_tokens"] > 0


def _walk(hf, prompt: list[int], emitted: list[int], k: int) -> int:
    """Proposals accepted when the unbiased model drafts for its biased self: replayed on
    transformers, step by step as the engine verifies (``k`` greedy proposals, fewer near
    ``max_tokens``; accepted while they equal the emitted tokens; then one more token)."""
    accepted, pos, total = 0, 1, len(emitted)  # the first token comes from the prefill
    while pos < total:
        room, context, proposals = min(k, total - 1 - pos), prompt + emitted[:pos], []
        for _ in range(room):
            with torch.no_grad():
                logits = hf(torch.tensor([context + proposals])).logits[0, -1]
            proposals.append(int(logits.argmax()))
        hits = 0
        while hits < room and proposals[hits] == emitted[pos + hits]:
            hits += 1
        accepted += hits
        pos += hits + 1
    return accepted


def test_acceptance_equals_a_transformers_walk(tiny_engine_factory, tiny_llama):
    """The target's logit bias turns down its most frequent token, which its own draft (no
    bias) keeps proposing: rejections, and the draft's KV rolled back after each."""
    folder, hf = tiny_llama
    prompt = _prompts(1, seed=11)[0]
    first = run(tiny_engine_factory(), [prompt], GREEDY)[0].token_ids
    banned = max(set(first), key=first.count)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                            logit_bias={banned: -100.0})
    plain = run(tiny_engine_factory(), [prompt], params)[0].token_ids
    engine = tiny_engine_factory(speculative_config=_draft(folder, k=3))
    assert _run(engine, [prompt], params)[0].token_ids == plain
    s = engine.stats()
    assert s["spec_accepted_tokens"] == _walk(hf, prompt, plain, 3)
    assert s["spec_proposed_tokens"] > s["spec_accepted_tokens"] > 0


def test_abort_gives_the_draft_blocks_back(tiny_engine_factory, tiny_llama):
    engine = tiny_engine_factory(speculative_config=_draft(tiny_llama[0]))
    engine.add_request("a", _prompts(1)[0], GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.stats()["draft_kv_blocks_free"] < engine.stats()["draft_kv_blocks_total"]
    engine.abort("a")
    s = engine.stats()
    assert s["draft_kv_blocks_free"] == s["draft_kv_blocks_total"]


def test_pool_is_sized_with_the_draft_bytes(tiny_engine_factory, tiny_llama_folder):
    """Tiny target and draft (3 layers, 2 KV heads of 16, fp32), blocks of 16 tokens: each
    block is 2 x 3 x 2 x 16 x 16 x 4 = 12288 bytes, so 0.01 GiB holds 10737418 // 24576 = 436
    blocks of both."""
    engine = tiny_engine_factory(kv_cache_gib=0.01,
                                 speculative_config=_draft(tiny_llama_folder(seed=5)))
    s = engine.stats()
    assert s["kv_blocks_total"] == s["draft_kv_blocks_total"] == 436
    assert s["kv_pool_bytes"] == s["draft_kv_pool_bytes"] == 436 * 12288


def test_another_vocabulary_is_refused(tiny_engine_factory, tiny_llama_folder):
    with pytest.raises(InvalidParameterError, match="vocabulary of 300 tokens.* one of 320"):
        tiny_engine_factory(speculative_config=_draft(tiny_llama_folder(vocab=300)))


def test_gate_stops_a_draft_that_does_not_pay(tiny_engine_factory, tiny_llama_folder,
                                              monkeypatch, tmp_path):
    """Gate on, a random draft (acceptance about 0): after its first misses the draft runs
    only in the probe steps, not k forwards in every step (it would without the gate's say
    before drafting: 4 per step here). Steps are priced by the step models of the assumed
    CPU (no probe in the test's config folder), never the wall clock."""
    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path))
    prompts = _prompts(4)
    plain = tokens(run(tiny_engine_factory(), prompts, GREEDY))
    config = {"method": "draft_model", "model": str(tiny_llama_folder(seed=5)),
              "num_speculative_tokens": 4}
    engine = tiny_engine_factory(speculative_config=config)
    assert tokens(_run(engine, prompts, GREEDY)) == plain
    s = engine.stats()
    assert s["draft_steps"] < GREEDY.max_tokens / 2
