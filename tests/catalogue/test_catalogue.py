"""The model catalogue: HF ids resolve offline from the packaged configs (``plan``, ``models``).

Expected figures come from the models' published architectures (layers x 2 x KV heads x
head_dim x 2 bytes for bf16), not from the code under test.
"""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.model.catalogue import entries, find

LLAMA_8B_BF16 = 32 * 2 * 8 * 128 * 2  # 32 layers, 8 KV heads, head_dim 128 (model card)
GPT2_BF16 = 12 * 2 * 12 * 64 * 2  # 12 layers, 12 heads of 64, MHA


def run(*args: str):
    return CliRunner().invoke(app, list(args))


def test_catalogue_holds_the_known_families():
    ids = {e.model_id for e in entries()}
    assert len(ids) >= 20
    assert {"meta-llama/Llama-3.1-8B", "deepseek-ai/DeepSeek-V3", "openai/gpt-oss-20b",
            "Qwen/Qwen3-Next-80B-A3B-Thinking", "google/gemma-2-9b"} <= ids
    assert all(e.path.is_file() for e in entries())


@pytest.mark.parametrize("model_id", [e.model_id for e in entries()])
def test_every_shipped_config_plans(model_id):
    r = run("plan", model_id, "--json", "--context", "4096")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["model"] == model_id
    assert out["kv_bytes_per_token"] > 0
    assert out["contexts"][0]["context"] == 4096


def test_id_is_case_insensitive():
    r = run("plan", "META-LLAMA/llama-3.1-8b", "--json", "--context", "8192")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["model"] == "meta-llama/Llama-3.1-8B"
    assert out["kv_bytes_per_token"] == LLAMA_8B_BF16
    assert find("qwen/QWEN3-8b").model_id == "Qwen/Qwen3-8B"


@pytest.mark.parametrize("given, closest", [
    ("meta-llama/Llama-3-8B", "meta-llama/Llama-3.1-8B"),
    ("llama-3.1-8b", "meta-llama/Llama-3.1-8B"),
    ("qwen/qwen3-8", "Qwen/Qwen3-8B"),
])
def test_unknown_id_suggests_closest(given, closest):
    r = run("plan", given)
    assert r.exit_code == 2
    message = r.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message
    assert f"closest: {closest}" in message
    assert "kvledger models" in message


def test_nothing_close_gives_no_suggestion():
    r = run("plan", "zzzzzzzzzzzzzzzzzz")
    assert r.exit_code == 2
    assert "closest" not in r.stderr and "kvledger models" in r.stderr


@pytest.mark.parametrize("path", ["./meta-llama/Llama-3.1-8B", "models/meta-llama/Llama-3.1-8B",
                                  "meta-llama__Llama-3.1-8B.json", "/nowhere/config.json"])
def test_missing_paths_keep_the_path_error(path):
    r = run("plan", path)
    assert r.exit_code == 2
    assert "model path not found" in r.stderr and "catalogue" not in r.stderr


def test_local_path_wins_over_catalogue(tmp_path, monkeypatch):
    # a folder that happens to be named like an HF id holds GPT-2's config: the path is read
    local = tmp_path / "meta-llama" / "Llama-3.1-8B"
    local.mkdir(parents=True)
    shutil.copy(find("openai-community/gpt2").path, local / "config.json")
    monkeypatch.chdir(tmp_path)
    r = run("plan", "meta-llama/Llama-3.1-8B", "--json", "--context", "1024")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kv_bytes_per_token"] == GPT2_BF16


def test_models_json_rows():
    r = run("models", "--json")
    assert r.exit_code == 0, r.output
    rows = {row["model_id"]: row for row in json.loads(r.stdout)}
    assert len(rows) == len(entries())
    llama = rows["meta-llama/Llama-3.1-8B"]
    assert (llama["num_kv_heads"], llama["head_dim"], llama["kv_bytes_per_token"]) == (
        8, 128, LLAMA_8B_BF16)
    assert llama["layer_kinds"] == "full 32"
    # Gemma 2: 42 layers alternating local (sliding) and global attention
    assert rows["google/gemma-2-9b"]["layer_kinds"] == "sliding 21 + full 21"
    # Qwen3-Next: one full-attention layer in four, the rest Gated DeltaNet
    assert rows["Qwen/Qwen3-Next-80B-A3B-Thinking"]["layer_kinds"] == "linear 36 + full 12"
    v3 = rows["deepseek-ai/DeepSeek-V3"]
    assert v3["layer_kinds"] == "mla 61"
    # one latent of kv_lora_rank 512 + rope 64 per layer (arXiv:2412.19437), bf16
    assert v3["mla_latent_dim"] == 576 and v3["kv_bytes_per_token"] == 61 * 576 * 2
    assert llama["mla_latent_dim"] is None


def test_models_table_and_fp8_column():
    r = run("models", "--kv-dtype", "fp8")
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if "meta-llama/Llama-3.1-8B " in x)
    # fp8: one byte per element + an fp32 scale per 16-token block, KV head and K/V:
    # 32 layers x 8 heads x (2 x 16 x 128 + 8) / 16 = 65,664 B = 64.1 KiB (bf16: 128 KiB)
    assert "64.1 KiB" in line
    assert run("models", "--kv-dtype", "fp7").exit_code == 2
