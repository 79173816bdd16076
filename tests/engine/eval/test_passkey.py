"""``kvledger eval passkey``: the prompt hides the key where asked, the model's answer is read."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvledger.eval.passkey import ANSWER_TOKENS, NEEDLE, passkey, passkey_prompt, passkey_prompts


@pytest.fixture(scope="module")
def tokenizer():
    from kvledger.model.weights.loader import load_tokenizer

    return load_tokenizer("default")


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_has_the_length_and_the_key_at_its_depth(tokenizer, depth):
    ids = passkey_prompt(tokenizer, 600, depth, "48213")
    assert len(ids) == 600 - ANSWER_TOKENS
    needle = tokenizer.encode(NEEDLE.format(key="48213"), add_special_tokens=False)
    at = next(i for i in range(len(ids)) if ids[i:i + len(needle)] == needle)
    assert at / len(ids) == pytest.approx(depth, abs=0.1)


class _RecordingEngine:
    """An engine stub that records each prompt and answers with its last 3 ids' text."""

    kv_format = "bf16"

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.prompts, self.pending = tokenizer, [], None

    def add_request(self, request_id, ids, params) -> None:
        self.prompts.append(ids)
        self.pending = self.tokenizer.decode(ids[-3:])

    def has_unfinished_requests(self) -> bool:
        return self.pending is not None

    def step(self):
        text, self.pending = self.pending, None
        return [SimpleNamespace(finished=True, error=None, text=text)]


def test_prompts_are_the_ones_passkey_runs(tokenizer):
    """``passkey_prompts`` (what benchmarks hand to a peer) lists exactly the prompts and keys
    ``passkey`` runs: keys drawn from Python's ``random.Random(seed)`` in depth order."""
    rng = random.Random(7)
    keys = [str(rng.randrange(10000, 100000)) for _ in range(4)]
    listed = passkey_prompts(tokenizer, 600, [0.0, 1.0], trials=2, seed=7)
    assert [(d, k) for d, k, _ in listed] == list(zip([0.0, 0.0, 1.0, 1.0], keys))
    assert [ids for _, _, ids in listed] == [passkey_prompt(tokenizer, 600, d, k)
                                             for d, k in zip([0.0, 0.0, 1.0, 1.0], keys)]
    engine = _RecordingEngine(tokenizer)
    result = passkey(engine, 600, [0.0, 1.0], trials=2, seed=7)
    assert engine.prompts == [ids for _, _, ids in listed]
    assert [t.key for t in result.trials] == keys


@pytest.mark.slow
def test_bundled_model_finds_a_key_in_a_short_context():
    from kvledger.engine.config import EngineConfig
    from kvledger.eval.passkey import passkey
    from kvledger.eval.scoring import load_engines

    engine, _ = load_engines(EngineConfig(), 512)
    result = passkey(engine, 512, [0.2, 0.8])
    assert [t.retrieved for t in result.trials] == [True, True], result.trials
