"""Self-consistency of the engine (fp32 greedy): the same tokens whatever the batching, the
prefix cache, the pool size, the prefill chunking or the KV cache itself (DESIGN.md oracles).

The tiny random Llama keeps these fast; the bundled-model variants are marked slow.
"""

from __future__ import annotations

import pytest

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import ContextLengthError, InvalidParameterError, KVBudgetError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(n: int, length: int = 40, shared: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(7)
    prefix = [rng.randrange(3, 320) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 320) for _ in range(length - shared + i)] for i in range(n)]


def _run(engine, prompts, params=GREEDY) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert all(o.finish_reason == "length" for o in done.values())
    return [done[f"r{i}"].token_ids for i in range(len(prompts))]


def _idle_accounting(engine) -> None:
    s = engine.stats()
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert s["kv_usage"] == 0


def test_batch_of_16_equals_alone(tiny_engine_factory):
    prompts = _prompts(16)
    alone = [_run(tiny_engine_factory(), [p])[0] for p in prompts]
    engine = tiny_engine_factory()
    assert _run(engine, prompts) == alone
    _idle_accounting(engine)


def test_batch_of_very_different_lengths_equals_alone(tiny_engine_factory):
    """Decodes of contexts 10..300 tokens fall into several length groups in one step."""
    import random

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (10, 13, 40, 90, 100, 300)]
    alone = [_run(tiny_engine_factory(), [p])[0] for p in prompts]
    assert _run(tiny_engine_factory(), prompts) == alone


def test_no_kv_cache_equals_paged(tiny_engine_factory):
    prompts = _prompts(3)
    assert _run(tiny_engine_factory(use_kv_cache=False), prompts) == _run(
        tiny_engine_factory(), prompts
    )


def test_prefix_cache_off_cold_warm_agree(tiny_engine_factory):
    prompts = _prompts(4, length=70, shared=50)
    off = _run(tiny_engine_factory(enable_prefix_caching=False), prompts)
    engine = tiny_engine_factory()
    cold = _run(engine, prompts)
    warm = _run(engine, prompts)
    assert off == cold == warm
    s = engine.stats()
    assert s["prefix_cache_hit_tokens"] >= 3 * 48  # 3 full shared blocks, at least, per rerun
    _idle_accounting(engine)


def test_chunked_prefill_equals_whole(tiny_engine_factory):
    prompts = _prompts(3, length=100)
    whole = _run(tiny_engine_factory(max_num_batched_tokens=2048), prompts)
    chunked = _run(tiny_engine_factory(max_num_batched_tokens=24), prompts)
    assert whole == chunked


def test_small_pool_preempts_and_matches_unbounded(tiny_engine_factory):
    prompts = _prompts(8, length=40)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    big = _run(tiny_engine_factory(), prompts, params)
    engine = tiny_engine_factory(num_blocks=12)  # each request needs up to 6 blocks
    small = _run(engine, prompts, params)
    assert small == big
    assert engine.stats()["num_preemptions"] > 0
    _idle_accounting(engine)


def test_request_larger_than_pool_fails_small_one_completes(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=4)
    with pytest.raises(KVBudgetError, match="block"):
        engine.add_request("big", list(range(3, 100)), GREEDY)
    assert len(_run(engine, _prompts(1, length=10))[0]) == GREEDY.max_tokens
    _idle_accounting(engine)


def test_abort_mid_chunked_prefill_frees_blocks(tiny_engine_factory):
    engine = tiny_engine_factory(max_num_batched_tokens=16)
    engine.add_request("long", list(range(3, 200)), GREEDY)
    engine.step()
    assert engine.stats()["kv_blocks_free"] < engine.stats()["kv_blocks_total"]
    engine.abort("long")
    assert not engine.has_unfinished_requests()
    s = engine.stats()
    assert s["kv_blocks_total"] - s["kv_blocks_free"] == 0


def test_bad_requests_are_refused_clearly(tiny_engine_factory):
    engine = tiny_engine_factory()
    with pytest.raises(ContextLengthError, match="512"):
        engine.add_request("a", [5] * 600, GREEDY)
    with pytest.raises(ContextLengthError, match="max_tokens is 100"):
        engine.add_request("b", [5] * 500, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
        engine.add_request("c", [5, 10_000], GREEDY)
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    quota = tiny_engine_factory(max_kv_tokens_per_request=64)
    with pytest.raises(KVBudgetError):
        quota.add_request("d", [5] * 60, SamplingParams(max_tokens=10))
    assert not engine.has_unfinished_requests()


def test_pool_bytes_equal_ledger(tiny_engine_factory):
    from kvledger.ledger.kv import kv_bytes_per_block
    from kvledger.ledger.kv_format import KVFormatSpec

    engine = tiny_engine_factory(num_blocks=37)
    spec = engine.spec
    by_hand = 37 * 16 * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    assert engine.store.nbytes == by_hand == 37 * kv_bytes_per_block(spec, KVFormatSpec("fp32"), 1, 16)


@pytest.mark.parametrize("kv_cache_dtype, element_bytes", [("bf16", 2), ("fp16", 2), ("auto", 4)])
def test_half_precision_kv_under_fp32_compute(tiny_engine_factory, kv_cache_dtype, element_bytes):
    spec = tiny_engine_factory(num_blocks=1).spec
    engine = tiny_engine_factory(num_blocks=37, kv_cache_dtype=kv_cache_dtype)
    per_block = 16 * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * element_bytes
    assert engine.store.nbytes == 37 * per_block
    full = _run(tiny_engine_factory(num_blocks=37), _prompts(2))
    half = _run(engine, _prompts(2))
    agree = sum(a == b for x, y in zip(full, half) for a, b in zip(x, y))
    assert agree >= 0.75 * sum(map(len, full))  # a 16-bit cache keeps most greedy tokens


@pytest.mark.slow
def test_bundled_model_same_tokens_alone_batched_warm_and_preempted(bundled_llm):
    from kvledger import LLM

    system = "You are a terse assistant. Answer in one short sentence, no lists."
    questions = [
        "What is a KV cache?",
        "Why is decoding memory-bound?",
        "Name a prime number.",
        "What is the capital of Italy?",
        "What does GQA stand for?",
        "Say hello.",
    ]
    prompts = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions
    ]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = [bundled_llm.generate(p, params)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in bundled_llm.generate(prompts, params)]  # warm prefix cache
    assert batched == alone
    assert bundled_llm.engine.stats()["prefix_cache_hit_tokens"] > 0
    small = LLM("default", dtype="fp32", num_blocks=16)  # 6 x ~4 blocks needed: preemption
    preempted = [o.token_ids for o in small.generate(prompts, params)]
    assert preempted == alone
    assert small.engine.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("option", [{"block_size": 0}, {"num_blocks": -1}, {"long_kv_share": 0},
                                    {"long_kv_share": 1.5}, {"max_num_seqs": 0},
                                    {"num_threads": 0}, {"kv_cache_dtype": "int5"},
                                    {"kv_group_size": 0}, {"kv_key_quant": "per-row"},
                                    {"kv_outlier_channels": -1}])
def test_bad_engine_options_are_refused(option):
    from kvledger.engine.config import EngineConfig

    with pytest.raises(InvalidParameterError, match=next(iter(option))):
        EngineConfig(**option)


def test_an_unknown_compute_dtype_is_refused_by_name():
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine

    with pytest.raises(InvalidParameterError, match="dtype must be one of bf16, fp32, got 'fp16'"):
        LLMEngine(EngineConfig(dtype="fp16"))  # refused before the model is read


def test_omitted_max_tokens_means_up_to_the_quota_or_pool(tiny_engine_factory):
    quota = tiny_engine_factory(max_kv_tokens_per_request=64)
    quota.add_request("q", [5] * 40, SamplingParams(max_tokens=None, temperature=0.0,
                                                     ignore_eos=True))
    small = tiny_engine_factory(num_blocks=3)  # 48 KV slots: 49 tokens at most
    small.add_request("p", [5] * 40, SamplingParams(max_tokens=None, temperature=0.0,
                                                     ignore_eos=True))
    lengths = {}
    for engine in (quota, small):
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    lengths[out.request_id] = (len(out.token_ids), out.finish_reason)
    assert lengths == {"q": (64 - 40, "length"), "p": (49 - 40, "length")}


def test_failed_generate_leaves_the_llm_usable(tiny_engine_factory):
    from kvledger.engine.llm import LLM

    llm = LLM.__new__(LLM)  # an LLM over the tiny engine, without loading a model
    llm.engine, llm.tokenizer = tiny_engine_factory(), None
    import itertools

    llm._counter = itertools.count()
    with pytest.raises(InvalidParameterError, match="vocabulary"):
        llm.generate([[5, 6], [7, 10_000]], GREEDY)  # the second is refused after the first
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["kv_blocks_free"] == llm.engine.stats()["kv_blocks_total"]
    assert len(llm.generate([[5, 6]], GREEDY)[0].token_ids) == GREEDY.max_tokens
    for bad in ({"temperature": float("nan")}, {"seed": 2**70}):
        with pytest.raises(InvalidParameterError):
            SamplingParams(**bad)


def test_kv_bytes_predicted_counts_a_shared_prefix_once(tiny_engine_factory):
    # issue 14: the prediction summed every request's tokens, so a shared prefix was counted
    # once per holder and the predicted bytes exceeded the allocated ones
    engine = tiny_engine_factory(block_size=16)
    shared = list(range(3, 67))  # 64 tokens = 4 full blocks, computed once and shared
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("first", shared + [100], params)
    engine.step()  # the first request computes (and registers) the shared blocks
    for i in range(3):
        engine.add_request(f"r{i}", shared + [101 + i], params)
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        s = engine.stats()
        seen.append((s["kv_bytes_predicted"], s["kv_bytes_allocated"]))
        held = {b for r in engine.scheduler.requests.values() for b in r.block_table}
        tokens = 0
        for b in held:  # by hand: each distinct block's filled tokens
            tokens += max(min(16, r.num_computed_tokens - r.block_table.index(b) * 16)
                          for r in engine.scheduler.requests.values() if b in r.block_table)
        assert s["kv_bytes_predicted"] == tokens * engine.bytes_per_token
    assert all(p <= a for p, a in seen) and seen[0][0] > 0


def test_chat_and_outputs_as_vllm_spells_them(bundled_llm):
    """``LLM.chat`` renders through the tokenizer's own template (transformers'
    ``apply_chat_template`` is the reference); ``outputs[0]`` mirrors the request's output."""
    conversation = [{"role": "user", "content": "Name a prime number."}]
    ids = list(bundled_llm.tokenizer.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"])
    params = SamplingParams(max_tokens=4, temperature=0.0)
    by_ids = bundled_llm.generate(ids, params)[0]
    one = bundled_llm.chat(conversation, params)
    two = bundled_llm.chat([conversation, conversation], params)
    assert one[0].prompt_token_ids == ids
    assert [o.outputs[0].token_ids for o in one + two] == [by_ids.token_ids] * 3
    assert one[0].outputs[0].text == by_ids.text and one[0].outputs[0].index == 0
    with pytest.raises(InvalidParameterError, match="conversation"):
        bundled_llm.chat("Name a prime number.", params)
