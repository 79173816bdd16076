"""The whole command against the scripted server: no /metrics, no /tokenize, every output."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fake_sse import FakeServer
from typer.testing import CliRunner

from kvledger.bench.records import Level, RequestSpec
from kvledger.bench.runner import LevelRunner
from kvledger.bench.target import Target
from kvledger.cli import app


def test_cli_sweep_writes_every_output(fake_server, tmp_path):
    out = tmp_path / "bench"
    result = CliRunner().invoke(app, [
        "bench", "--url", fake_server.url, "--endpoint", "completions",
        "--prompt-lens", "64,128,256,512", "--output-len", "5", "--concurrency", "1,2",
        "--requests", "2", "--warmup", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("results.json", "results.csv", "report.html", "ttft_vs_prompt.png",
                 "tpot_vs_context.png", "throughput_vs_concurrency.png"):
        assert (out / name).stat().st_size > 0, name
    body = json.loads((out / "results.json").read_text())
    assert body["meta"]["model"] == "steady"  # the first of /v1/models
    assert len(body["summaries"]) == 8 and len(body["requests"]) == 16
    assert all(r["ok"] and r["output_tokens"] == 5 for r in body["requests"])
    notes = " ".join(body["notes"])
    assert "no /tokenize" in notes and "no Prometheus /metrics" in notes
    assert "TTFT" in body["definitions"]
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3
    assert "<h2>Definitions</h2>" in html and "<h2>Anomalies</h2>" in html
    assert "usage chunk" in html  # the TPOT definition is printed
    assert len((out / "results.csv").read_text().splitlines()) == 17


def test_failures_are_counted_not_zeroed(fake_server):
    async def go(script):
        target = Target.from_url(fake_server.url, endpoint="completions")
        target.model = script
        level = Level("sweep", 8, 2, [RequestSpec(str(i), "hello there", 8) for i in range(3)])
        async with httpx.AsyncClient(timeout=5) as client:
            return await LevelRunner(client, target, 4, watch_metrics=False).run(level)

    records, summary = asyncio.run(go("done-only"))
    assert summary["failures"] == 3 and not any(r.ok for r in records)
    assert summary["ttft_s"] == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    assert summary["output_throughput_tok_s"] == 0.0
    records, summary = asyncio.run(go("role-pause"))
    assert summary["failures"] == 0 and summary["ttft_s"]["n"] == 3
    assert summary["slot_wait_s"]["n"] == 3


def test_a_server_that_cannot_generate_is_a_user_error(fake_server):
    result = CliRunner().invoke(app, ["bench", "--url", fake_server.url, "--model", "done-only",
                                      "--prompt-lens", "64", "--output-len", "4"])
    assert result.exit_code == 2
    assert "warm-up request" in result.output


def test_chat_growth_and_shared_prefix_run(fake_server, tmp_path):
    for workload in ("chat-growth", "shared-prefix"):
        result = CliRunner().invoke(app, [
            "bench", "--url", fake_server.url, "--workload", workload, "--prompt-lens", "128",
            "--output-len", "3", "--turn-tokens", "16", "--turns", "3", "--warmup", "1",
            "--out", str(tmp_path / workload)])
        assert result.exit_code == 0, result.output
        body = json.loads((tmp_path / workload / "results.json").read_text())
        assert all(r["ok"] for r in body["requests"])
        if workload == "shared-prefix":
            assert "median TTFT cold" in result.output
            assert [r["phase"] for r in body["requests"]] == ["cold", "warm", "warm", "warm"]
        else:
            assert [r["turn"] for r in body["requests"]] == [1, 2, 3]
    assert (tmp_path / "shared-prefix" / "shared_prefix_ttft.png").exists()
    assert (tmp_path / "chat-growth" / "tpot_vs_context.png").exists()


@pytest.mark.parametrize("args, message", [
    (["--url", "http://127.0.0.1:9"], "cannot reach"),
    (["--url", "127.0.0.1:8000"], "must start with http"),
    (["--url", "http://x", "--workload", "soak"], "--workload must be one of"),
    (["--url", "http://x", "--prompt-lens", "2k,abc"], "comma-separated integers"),
    (["--url", "http://x", "--plan-model", "default"], "needs both"),
])
def test_user_errors_exit_2(args, message):
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2 and message in result.output


def test_llamacpp_tokenize_and_api_key_from_the_environment(tmp_path, monkeypatch):
    with FakeServer(tokenize="llama.cpp", api_key="sekret") as server:
        args = ["bench", "--url", server.url, "--prompt-lens", "40", "--output-len", "3",
                "--requests", "1", "--warmup", "1", "--out", str(tmp_path)]
        refused = CliRunner().invoke(app, args)
        assert refused.exit_code == 2 and "refused the API key" in refused.output
        monkeypatch.setenv("OPENAI_API_KEY", "sekret")
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    body = json.loads((tmp_path / "results.json").read_text())
    assert body["meta"]["token_counts"] == "server POST /tokenize (llama.cpp)"
    (record,) = body["requests"]
    # the fake counts one token per word, in /tokenize and in usage: the prompt sent had
    # exactly 40 words, and no template overhead was found
    assert record["ok"] and record["prompt_tokens"] == 40
    assert body["meta"]["template_overhead_tokens"] == 0


@pytest.mark.slow
def test_local_gguf_tokenizer_when_the_server_has_no_tokenize(fake_server, tmp_path):
    from kvledger.paths import bundled_model_path

    result = CliRunner().invoke(app, [
        "bench", "--url", fake_server.url, "--tokenizer", str(bundled_model_path()),
        "--prompt-lens", "100", "--output-len", "3", "--requests", "1", "--warmup", "1",
        "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    body = json.loads((tmp_path / "results.json").read_text())
    assert body["meta"]["token_counts"].startswith("local tokenizer")
    assert body["requests"][0]["ok"]


def test_every_level_skipped_is_an_error_that_says_why(tmp_path):
    with FakeServer(max_model_len=100) as server:
        result = CliRunner().invoke(app, [
            "bench", "--url", server.url, "--endpoint", "completions", "--prompt-lens", "512",
            "--output-len", "4", "--warmup", "0", "--out", str(tmp_path / "b")])
    assert result.exit_code == 2, result.output
    assert "no level ran" in result.output and "exceed the model's context of 100" in \
        result.output


def test_a_404_from_the_url_is_reported_as_such(fake_server):
    result = CliRunner().invoke(app, ["bench", "--url", fake_server.url + "/api",
                                      "--prompt-lens", "64", "--output-len", "4"])
    assert result.exit_code == 2
    assert "answered HTTP 404" in result.output and "lists no model" not in result.output
