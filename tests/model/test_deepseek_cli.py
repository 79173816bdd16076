"""DeepSeek-V2 through ``kvledger generate``, ``serve``'s app and ``plan`` (issue 36, item 3):
the catalogue's DeepSeek-V2-Lite config shrunk in size with its experts, top-k, YaRN and
dense first layer kept, dummy weights and the bundled tokenizer; the KV bill is the latent's,
``(kv_lora_rank + qk_rope_head_dim) x layers x element bytes`` per token."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.data import config_path

LITE = "deepseek-ai__DeepSeek-V2-Lite"
SHRUNK = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 32,
          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 49152,
          "moe_intermediate_size": 32}
LATENT_FP32 = (32 + 8) * 2 * 4  # bytes per token: (rank + rope) x layers x fp32


def _shrunk(folder):
    raw = json.loads(config_path(LITE).read_text())
    raw.update(SHRUNK)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_generate_bills_the_latent(tmp_path):
    folder = _shrunk(tmp_path / "lite")
    result = CliRunner().invoke(app, ["generate", "hi", "--model", str(folder), "--load-format",
                                      "dummy", "--dtype", "fp32", "--max-tokens", "3",
                                      "--num-blocks", "4", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output.strip().splitlines()[-1])
    assert len(doc["token_ids"]) == 3
    assert doc["kv_bytes_per_token"] == LATENT_FP32
    assert doc["kv_pool_bytes"] == 4 * 16 * LATENT_FP32
    assert doc["metrics"]["kv_bytes_held"] == 16 * LATENT_FP32


def test_serve_answers_a_completion(tmp_path, app_client):
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine

    folder = _shrunk(tmp_path / "lite")
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="fp32", load_format="dummy",
                                    num_blocks=8))
    client = app_client(engine)
    reply = client.post("/v1/completions", json={"model": "lite", "prompt": "Hello",
                                                 "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    sinks = {"policy": "sinks", "window": 32, "sinks": 4}
    reply = client.post("/v1/completions", json={"model": "lite", "prompt": "Hello",
                                                 "max_tokens": 4, "kv_policy": sinks})
    assert reply.status_code == 400 and "MLA" in reply.text, reply.text


def test_plan_prices_the_latent():
    """DeepSeek-V2-Lite in bf16: (512 + 64) x 27 x 2 = 31,104 B per token, one mla kind."""
    result = CliRunner().invoke(app, ["plan", "deepseek-ai/DeepSeek-V2-Lite", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["kv_bytes_per_token"] == 31_104
    assert [(k["kind"], k["layers"]) for k in doc["layer_kinds"]] == [("mla", 27)]
