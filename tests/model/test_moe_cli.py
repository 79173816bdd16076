"""The MoE families through ``kvledger generate`` and ``kvledger serve``'s app (issue 35): real
catalogue configs (Mixtral-8x7B, Qwen3-30B-A3B, gpt-oss-20b) shrunk in size with their expert count and
top-k kept, dummy weights and the bundled tokenizer; tensor parallelism refuses them in one
line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.data import config_path

CONFIGS = {"mixtral": "mistralai__Mixtral-8x7B-v0.1", "qwen3_moe": "Qwen__Qwen3-30B-A3B",
           "gpt_oss": "openai__gpt-oss-20b"}


def _shrunk(folder, name: str):
    """``name``'s catalogue config with 2 layers of 64 (experts, top-k and the first two layer
    kinds as they are)."""
    raw = json.loads(config_path(name).read_text())
    if "layer_types" in raw:
        raw["layer_types"] = raw["layer_types"][:2]
    raw.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=49152, moe_intermediate_size=32)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_generate_runs_the_family(tmp_path, family):
    folder = _shrunk(tmp_path / family, CONFIGS[family])
    result = CliRunner().invoke(app, ["generate", "hi", "--model", str(folder), "--load-format",
                                      "dummy", "--max-tokens", "3", "--num-blocks", "4",
                                      "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    assert len(doc["token_ids"]) == 3


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_serve_answers_a_completion(tmp_path, app_client, family):
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine

    folder = _shrunk(tmp_path / family, CONFIGS[family])
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="fp32", load_format="dummy",
                                    num_blocks=8))
    client = app_client(engine)
    reply = client.post("/v1/completions", json={"model": family, "prompt": "Hello",
                                                 "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4


def test_tensor_parallelism_refuses_experts_in_one_line(tmp_path):
    folder = _shrunk(tmp_path / "q", CONFIGS["qwen3_moe"])
    result = CliRunner().invoke(app, ["generate", "hi", "--model", str(folder), "--load-format",
                                      "dummy", "--tensor-parallel-size", "2"])
    assert result.exit_code == 2
    line, = result.output.strip().splitlines()
    assert "routes to 128 experts" in line and "does not shard experts" in line
