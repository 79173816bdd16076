"""``kvledger eval passkey``: the prompt hides the key where asked, the model's answer is read."""

from __future__ import annotations

import pytest

from kvledger.eval.passkey import ANSWER_TOKENS, NEEDLE, passkey_prompt


@pytest.fixture(scope="module")
def tokenizer():
    from kvledger.engine.loader import load_tokenizer

    return load_tokenizer("default")


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_prompt_has_the_length_and_the_key_at_its_depth(tokenizer, depth):
    ids = passkey_prompt(tokenizer, 600, depth, "48213")
    assert len(ids) == 600 - ANSWER_TOKENS
    needle = tokenizer.encode(NEEDLE.format(key="48213"), add_special_tokens=False)
    at = next(i for i in range(len(ids)) if ids[i:i + len(needle)] == needle)
    assert at / len(ids) == pytest.approx(depth, abs=0.1)


@pytest.mark.slow
def test_bundled_model_finds_a_key_in_a_short_context():
    from kvledger.engine.config import EngineConfig
    from kvledger.eval.passkey import passkey
    from kvledger.eval.scoring import load_engines

    engine, _ = load_engines(EngineConfig(), 512)
    result = passkey(engine, 512, [0.2, 0.8])
    assert [t.retrieved for t in result.trials] == [True, True], result.trials
