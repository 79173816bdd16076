"""``kvledger probe`` with the kernel probe, through the real CLI app."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.data import configs_dir

SMOL = str(configs_dir() / "HuggingFaceTB__SmolLM2-135M.json")


def test_probe_prints_cpu_choices_and_times_and_caches_them(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(app, ["probe", "--buffer-mib", "4", "--matmul-n", "64", "--repeats",
                                 "1", "--model", SMOL, "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert "CPU: " in r.stdout
    for cls in ("qkv", "o", "gate_up", "down", "lm_head"):
        assert cls in r.stdout
    assert "attention (1 query, 512 positions)" in r.stdout
    cached = json.loads((tmp_path / "cache" / "probe" / "kernels.json").read_text())
    (entry,) = cached.values()
    assert entry["matmul_us"]["lm_head"]["dense"] > 0
    assert str(tmp_path / "cache" / "probe" / "kernels.json") in r.stdout.replace("\n", "")


def test_probe_rejects_bad_threads():
    r = CliRunner().invoke(app, ["probe", "--threads", "0"])
    assert r.exit_code == 2
    assert "--threads must be an integer in [1, 4096]" in r.output


def test_probe_of_a_kquant_gguf_picks_among_the_kquant_formats(tmp_path, monkeypatch):
    """Every class of a K-quant GGUF (held as its blocks) is offered only the kquant formats."""
    from pathlib import Path

    pytest.importorskip("torch")
    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "cache"))
    fixture = Path(__file__).parents[1] / "model" / "fixtures" / "tiny-q4_k_m.gguf"
    r = CliRunner().invoke(app, ["probe", "--buffer-mib", "4", "--matmul-n", "64", "--repeats",
                                 "1", "--model", str(fixture), "--threads", "1"])
    assert r.exit_code == 0, r.output
    picks = [line.rsplit("-> ", 1)[1] for line in r.stdout.splitlines()
             if line.strip().split(" ", 1)[0] in ("qkv", "o", "gate_up", "down", "lm_head")]
    assert len(picks) == 5 and all(p.startswith("kquant-") for p in picks), r.stdout


@pytest.mark.slow
def test_probe_saves_the_disk_tiers_read_speed_beside_the_prefill_speed(tmp_path, monkeypatch):
    """``probe --kv-disk-dir`` measures the tier's loads (cold and warm) and the model's
    prefill speed, and saves them where the engine and ``plan --kv-disk-dir`` read them."""
    from kvledger.ledger.tier_load import saved_figures

    pytest.importorskip("torch")
    monkeypatch.setenv("KVLEDGER_CONFIG_DIR", str(tmp_path / "config"))
    model = "default"  # its kernel probe is cached by the engine tests (user cache folder)
    r = CliRunner().invoke(app, ["probe", "--buffer-mib", "4", "--matmul-n", "64", "--repeats",
                                 "1", "--no-kernels", "--model", model,
                                 "--kv-disk-dir", str(tmp_path / "kv")])
    assert r.exit_code == 0, r.output
    assert "KV disk tier" in r.stdout and "GFLOP/s" in r.stdout
    saved = json.loads((tmp_path / "config" / "kv_tier_read.json").read_text())
    (figures,) = saved.values()
    assert figures["prefill_model"] == model and figures["prefill_tokens"] == 512
    # 30 layers x 3 KV heads x 64 head_dim x K and V x 2 bytes (bf16) x 16 tokens
    assert figures["payload_bytes"] == 30 * 3 * 64 * 2 * 2 * 16
    read = saved_figures(tmp_path / "kv", tmp_path / "config")
    assert read.cold is not None and read.warm is not None and read.prefill_flops_per_s > 0
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == ["lock"]  # scratch removed
