"""Sessions across a restart with the disk KV tier (bundled model, fp32, greedy): a Responses
API conversation continued after a restart, and a chat completion that resends its history,
get the cached tokens the in-memory prefix cache gives without a restart, from the disk tier.

The oracle of the cached tokens is the in-memory prefix cache (and its rule: the longest common
token prefix in whole blocks, the last token excluded); of the text, the run without a restart.
"""

from __future__ import annotations

import pytest
import torch
from session_fakes import openai_client

from kvledger.sessions.service import SessionOptions

pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture(scope="module")
def model():
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    spec, weights = load_weights("default", torch.float32)
    return spec, weights, load_tokenizer("default")


@pytest.fixture
def new_server(model, make_app, tmp_path):
    """``new_server(sessions, tier=True)``: a fresh engine (empty pool) on the same tier
    directory, or with no tier at all (the in-memory reference)."""
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine

    engines = []

    def make(sessions=None, tier=True):
        if engines:
            engines[-1].close()  # the old server stops: its writes land, its lock goes
        where = str(tmp_path / "kv") if tier else None
        engine = LLMEngine(EngineConfig(model="default", dtype="fp32", num_blocks=256,
                                        block_size=BLOCK, kv_disk_dir=where), *model)
        engines.append(engine)
        return make_app(engine, sessions=sessions)

    yield make
    engines[-1].close()


def _turn(client, text, prev):
    return openai_client(client).responses.create(
        input=text, previous_response_id=prev, temperature=0, max_output_tokens=16,
        extra_body={"memory": "full"})


def test_responses_conversation_after_a_restart_hits_the_disk_tier(new_server, tmp_path):
    options = SessionOptions(state_db=str(tmp_path / "state.db"))
    questions = ["My name is Ada and I keep bees in the garden behind my house.",
                 "What do I keep?", "Where do I keep them?", "What is my name?"]
    reference, prev = new_server(SessionOptions(state_db=str(tmp_path / "ref.db")),
                                 tier=False), None
    for q in questions:  # no restart, no tier: the in-memory prefix cache's hits
        in_memory = _turn(reference, q, prev)
        prev = in_memory.id
    server, prev = new_server(options), None
    for q in questions[:3]:
        prev = _turn(server, q, prev).id
    server = new_server(options)  # restart on the same state DB and tier directory
    after = _turn(server, questions[3], prev)
    cached = in_memory.usage.input_tokens_details.cached_tokens
    assert cached > 0 and cached % BLOCK == 0
    details = after.usage.input_tokens_details.model_dump()
    assert details["cached_tokens"] == cached
    assert details["cached_tokens_by_tier"] == {"pool": 0, "ram": 0, "disk": cached}
    assert after.output_text == in_memory.output_text


def test_chat_history_resent_after_a_restart_hits_the_disk_tier(new_server, tmp_path,
                                                                 monkeypatch):
    """With a probed read speed (1 GB/s, saved as ``kvledger probe`` saves it) the usage
    carries each load's prediction: blocks x 737,280 bytes (fp32: 2 x 30 layers x 3 KV heads
    x 64 x 4 bytes x 16 tokens) / 1e9."""
    from kvledger.ledger.tier_load import save_figures

    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path / "config"))
    save_figures(tmp_path / "kv", {"cold_bytes_per_s": 1e9, "warm_bytes_per_s": 1e9,
                                   "prefill_flops_per_s": 1.0}, tmp_path / "config")

    def chat(client, messages):
        return client.post("/v1/chat/completions", json={
            "messages": messages, "temperature": 0, "max_tokens": 16}).json()

    history = [{"role": "system", "content": "You are a patient tutor of astronomy."},
               {"role": "user", "content": "Why is the sky blue during the day and red at "
                                           "sunset? Answer in two sentences."}]
    reference = new_server(tier=False)
    first = chat(reference, history)
    turn = history + [{"role": "assistant",
                       "content": first["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And why is it black at night?"}]
    in_memory = chat(reference, turn)  # no restart, no tier: the in-memory prefix cache
    server = new_server()
    assert chat(server, history)["choices"][0]["message"] == first["choices"][0]["message"]
    server = new_server()  # restart on the same tier directory
    after = chat(server, turn)
    cached = in_memory["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    details = after["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == cached
    assert details["cached_tokens_by_tier"] == {"pool": 0, "ram": 0, "disk": cached}
    assert details["kv_tier_load_seconds"] > 0
    assert details["kv_tier_load_predicted_seconds"] == pytest.approx(
        cached // BLOCK * 737_280 / 1e9, abs=1e-6)
    assert after["choices"][0]["message"] == in_memory["choices"][0]["message"]
