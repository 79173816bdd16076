"""Sessions on the bundled model (fp32, greedy): exact ids, restarts, prefix-cache hits.

A "server restart" is a new app around a new engine (an empty KV pool and prefix cache) on the
same state DB; the weights are loaded once and shared, which changes nothing they compute.
The expected cache hit of a continued turn is the previous conversation's tokens that have KV
(all but the last generated token, which is never fed back) rounded down to whole blocks.
"""

from __future__ import annotations

import pytest
import torch
from session_fakes import openai_client

from kvledger.sessions.service import SessionOptions

pytestmark = pytest.mark.slow
BLOCK = 16
CHATML_USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = ["My name is Ada and I keep bees.", "What do I keep?", "What is my name?",
             "Name a flower bees like.", "Why do bees dance?", "How many legs has a bee?",
             "What is honey made of?", "Do bees sleep?", "What is a drone?",
             "Thank you, goodbye."]


@pytest.fixture(scope="module")
def model():
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    spec, weights = load_weights("default", torch.float32)
    return spec, weights, load_tokenizer("default")


@pytest.fixture
def new_server(model, make_app):
    """``new_server(**EngineConfig kwargs, sessions=..., api_key=...)``: a fresh engine's app."""
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine

    def make(sessions=None, api_key=None, **config):
        engine = LLMEngine(EngineConfig(model="default", dtype="fp32", num_blocks=512,
                                        block_size=BLOCK, **config), *model)
        return make_app(engine, sessions=sessions, api_key=api_key)

    return make


def _turn(client, text, prev, **kwargs):
    kwargs.setdefault("max_output_tokens", 24)
    r = openai_client(client, kwargs.pop("key", "none")).responses.create(
        input=text, previous_response_id=prev, temperature=0,
        extra_body={"memory": kwargs.pop("memory", "full")}, **kwargs)
    return r, client.app.state.sessions.store


def test_ten_turns_with_a_restart_match_and_hit_the_cache(new_server, model, tmp_path):
    tokenizer = model[2]
    reference, prev = [], None
    server = new_server(sessions=SessionOptions(state_db=str(tmp_path / "ref.db")))
    for q in QUESTIONS:
        r, _ = _turn(server, q, prev)
        reference.append(r.output_text)
        prev = r.id

    options = SessionOptions(state_db=str(tmp_path / "run.db"))
    server, prev, prev_ids = new_server(sessions=options), None, None
    for n, q in enumerate(QUESTIONS):
        if n == 5:  # restart: new engine, empty prefix cache, same state DB
            server.__exit__(None, None, None)
            server.app.state.sessions.store.close()
            server = new_server(sessions=options)
        r, store = _turn(server, q, prev)
        assert r.output_text == reference[n], f"turn {n}"
        rec = store.get_response("", r.id)
        prompt = rec.token_ids[: rec.prompt_len]
        cached = r.usage.input_tokens_details.cached_tokens
        if prev_ids is not None:
            assert prompt[: len(prev_ids)] == prev_ids  # ids reused, never re-tokenised
            added = tokenizer.decode(prompt[len(prev_ids):])
            closing = "\n" if prev_ids[-1] == tokenizer.eos_token_id else "<|im_end|>\n"
            assert added == closing + CHATML_USER.format(q)
            expected = 0 if n == 5 else (len(prev_ids) - 1) // BLOCK * BLOCK
            assert cached == expected, f"turn {n}"
        prev, prev_ids = r.id, rec.token_ids


def test_summary_under_budget_and_prefix_hit_between_rewrites(new_server):
    server = new_server(max_kv_tokens_per_request=640)
    budget, prev, rewrites = 640 - 16, None, 0
    for n in range(40):
        r, _ = _turn(server, f"Fact {n}: the box number {n} holds {n * 7} marbles.", prev,
                     memory="summary", truncation="auto", max_output_tokens=16)
        ext = r.model_extra["kvledger"]
        assert r.usage.input_tokens <= budget
        if ext["memory_event"] == "summary":
            rewrites += 1
        elif n and ext["summary_rewrites"]:
            assert ext["prefix_tokens"] % BLOCK == 0
            assert r.usage.input_tokens_details.cached_tokens >= ext["prefix_tokens"], f"turn {n}"
        prev = r.id
    assert rewrites >= 2


def test_prefix_cache_is_salted_per_key(new_server):
    server = new_server(api_key=["key-a", "key-b"])
    text = "Please describe the water cycle in three short sentences for a child."
    _turn(server, text, None, key="key-a")
    again, _ = _turn(server, text, None, key="key-a")
    other, _ = _turn(server, text, None, key="key-b")
    assert again.usage.input_tokens_details.cached_tokens >= BLOCK
    assert other.usage.input_tokens_details.cached_tokens == 0
