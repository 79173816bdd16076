"""``draft_model`` on the bundled SmolLM2-135M (fp32, greedy): with a tiny random draft that
has its tokenizer, and with itself as draft, the tokens are the target's alone; its own draft
is accepted (almost) every time; a draft of another vocabulary is a one-line CLI error."""

from __future__ import annotations

import pytest
from spec_kit import run, tokens
from typer.testing import CliRunner

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three primary colours are"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_smol_draft(tiny_llama_folder):
    """A tiny random Llama with SmolLM2's vocabulary and its tokenizer files."""
    from kvledger.model.weights.loader import load_tokenizer

    folder = tiny_llama_folder(vocab=49152, seed=3)
    load_tokenizer("default").save_pretrained(folder)
    return folder


def _engine(draft=None) -> LLMEngine:
    spec = None if draft is None else {"method": "draft_model", "model": str(draft),
                                        "num_speculative_tokens": 4, "gate": False}
    return LLMEngine(EngineConfig(model="default", dtype="fp32", speculative_config=spec))


def test_draft_pairs_emit_the_target_tokens(tiny_smol_draft):
    engine = _engine()
    prompts = [engine.tokenize(p) for p in PROMPTS]
    plain = tokens(run(engine, prompts, GREEDY))
    own = _engine("default")
    assert tokens(run(own, prompts, GREEDY)) == plain
    s = own.stats()
    assert s["spec_accepted_tokens"] >= 0.95 * s["spec_proposed_tokens"] > 0
    tiny = _engine(tiny_smol_draft)
    assert tokens(run(tiny, prompts, GREEDY)) == plain
    assert tiny.stats()["spec_proposed_tokens"] > 0


def test_another_vocabulary_is_a_cli_error(tiny_llama):
    from kvledger.cli import app

    config = f'{{"method": "draft_model", "model": "{tiny_llama[0]}"}}'
    result = CliRunner().invoke(app, ["generate", "hi", "--speculative-config", config])
    assert result.exit_code == 2, result.output
    assert "error: speculative_config model" in result.output
    assert "vocabulary of 320 tokens" in result.output and "49152" in result.output
