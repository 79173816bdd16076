"""``kvledger replay`` end to end: report files, sweep, determinism, load, bad input (exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.replay.trace import TraceWriter

MODEL = "meta-llama/Llama-3.1-8B"  # 131072-token context (its config.json)


@pytest.fixture
def trace_file(tmp_path):
    """40 requests, Poisson-ish arrivals, a 1024-token shared prefix on every other one."""
    import random

    rng = random.Random(0)
    w = TraceWriter(tmp_path / "t.jsonl", "test", MODEL, private=True, hash_block_size=16)
    shared = [f"{i:064x}" for i in range(64)]
    t = 0.0
    for i in range(40):
        t += rng.expovariate(20.0)
        n = rng.randrange(64, 2048)
        hashes = shared[: min(64, n // 16)] if i % 2 else []
        w.write({"type": "request", "id": f"q{i}", "arrival_s": t, "prompt_tokens": n,
                 "block_hashes": hashes, "max_tokens": 200,
                 "output_tokens": rng.randrange(20, 200)})
    w.write({"type": "request", "id": "huge", "arrival_s": t, "prompt_tokens": 200_000,
             "max_tokens": 10})
    w.close()
    return tmp_path / "t.jsonl"


def _run(*args):
    result = CliRunner().invoke(app, ["replay", *map(str, args)])
    return result.exit_code, result.output


def test_replay_writes_the_bench_report_and_counts_overlong_prompts(trace_file, tmp_path):
    out = tmp_path / "out"
    code, text = _run(trace_file, "--model", MODEL, "--device", "H100-SXM", "--out", out,
                      "--slo", "ttft:200,tpot:30")
    assert code == 0, text
    assert "1 request exceeds the model's context" in text
    body = json.loads((out / "results.json").read_text())
    s = body["summaries"][0]
    assert s["requests"] == 41 and s["failures"] == 1 and s["refused_context"] == 1
    assert s["ttft_s"]["p50"] > 0 and s["tpot_s"]["p50"] > 0
    assert 0 <= s["slo_attained"] <= 1
    assert len(body["replay_requests"]) == 41
    for name in ("results.csv", "replay_ttft_cdf.png", "replay_tpot_cdf.png",
                 "replay_timeline.png"):
        assert (out / name).is_file(), name
    assert (out / "report.html").read_text().count("<img") == 3


def test_same_trace_same_output(trace_file, tmp_path):
    args = ["--model", MODEL, "--device", "A100-80GB", "--max-num-seqs", "8"]
    _run(trace_file, *args, "--out", tmp_path / "a")
    _run(trace_file, *args, "--out", tmp_path / "b")
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert a["summaries"] == b["summaries"] and a["replay_requests"] == b["replay_requests"]


def test_sweep_one_row_per_setting_and_load_changes_queueing(trace_file, tmp_path):
    code, text = _run(trace_file, "--model", MODEL, "--device", "L4", "--tp", "1",
                      "--num-blocks", "300", "--sweep", "max-num-seqs=2,8,32", "--out", tmp_path)
    assert code == 0, text
    rows = {}
    for n in (2, 8, 32):
        rows[n] = json.loads((tmp_path / f"max-num-seqs-{n}" / "results.json").read_text())
        assert f"max-num-seqs={n}" in text
    q = {n: r["summaries"][0]["queue_s"]["p90"] for n, r in rows.items()}
    assert q[2] > q[32]  # fewer slots, longer queues
    # a pool of 300 blocks of 16 tokens cannot hold 32 long prompts: preemptions appear
    assert rows[32]["summaries"][0]["metrics"]["preemptions"] > 0


def test_speed_scales_arrivals_only(trace_file, tmp_path):
    base = ["--model", MODEL, "--device", "H100-SXM", "--max-num-seqs", "4"]
    _run(trace_file, *base, "--out", tmp_path / "x1")
    _run(trace_file, *base, "--speed", "4", "--out", tmp_path / "x4")
    one = json.loads((tmp_path / "x1" / "results.json").read_text())
    four = json.loads((tmp_path / "x4" / "results.json").read_text())
    a1 = {r["uid"]: r["arrival_s"] for r in one["requests"]}
    a4 = {r["uid"]: r["arrival_s"] for r in four["requests"]}
    assert all(a4[k] == pytest.approx(a1[k] / 4) for k in a1)
    assert four["summaries"][0]["queue_s"]["p90"] > one["summaries"][0]["queue_s"]["p90"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--device", "H900"], "unknown device 'H900'"),
    (["--device", "L4", "--slo", "ttft:fast"], "--slo ttft must be milliseconds"),
    (["--device", "L4", "--sweep", "colour=1,2"], "--sweep takes KEY=V1,V2"),
    (["--device", "L4", "--speed", "0"], "--speed must be a number in (0, 2^30]"),
    (["--device", "L4", "--kv-policy", "window", "--kv-window", "64", "--kv-cache-dtype",
      "int8"], "runs on full-precision KV"),
    (["--device", "L4", "--compare", "nothing.json"], "--compare: nothing.json not found"),
    (["--device", "L4", "--tp", "2", "--link-gbs", "0"], "--link-gbs must be a number in (0, 2^30]"),
])
def test_bad_options_exit_2_with_one_line(trace_file, extra, message):
    code, text = _run(trace_file, "--model", MODEL, *extra)
    assert code == 2 and message in text and len(text.strip().splitlines()) == 1, text


def test_malformed_trace_line_exit_2(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"type": "header", "format": "kvledger-trace", "version": 1}\n'
                    '{"type": "request", "id": "a", "arrival_s": 0, "prompt_tokens": 5}\n'
                    '{"type": "request", "id": "b", "arrival_s": 0, "prompt_tokens": "x"}\n')
    code, text = _run(path, "--model", MODEL, "--device", "L4")
    assert code == 2 and "bad.jsonl:3: field 'prompt_tokens' must be int" in text, text


def test_sweep_kv_cache_dtype_grows_the_pool(trace_file, tmp_path):
    """int8 KV per 16-token block and KV head of head_dim D: 2 x 16 x D code bytes + the values'
    fp16 scale and zero point per 32 elements per token (2 D) + the keys' per-channel scale and
    zero point (4 D) = 38 D bytes, against bf16's 64 D: 64 / 38 = 1.68x the blocks."""
    code, text = _run(trace_file, "--model", MODEL, "--device", "L4",
                      "--sweep", "kv-cache-dtype=bf16,int8", "--out", tmp_path)
    assert code == 0, text
    blocks = {f: json.loads((tmp_path / f"kv-cache-dtype-{f}" / "results.json").read_text())
              ["summaries"][0]["num_blocks"] for f in ("bf16", "int8")}
    assert blocks["int8"] / blocks["bf16"] == pytest.approx(64 / 38, rel=1e-3)


def test_sweep_kv_window_frees_blocks(trace_file, tmp_path):
    """Under sinks a sequence holds at most sinks + window - 1 tokens plus one 64-token chunk:
    a short window holds fewer blocks and preempts less than a window longer than any request
    (which holds what full retention holds)."""
    code, text = _run(trace_file, "--model", MODEL, "--device", "L4", "--num-blocks", "300",
                      "--max-num-seqs", "32", "--kv-policy", "sinks", "--kv-window", "8",
                      "--sweep", "kv-window=128,4096", "--out", tmp_path)
    assert code == 0, text
    runs = {w: json.loads((tmp_path / f"kv-window-{w}" / "results.json").read_text())
            for w in (128, 4096)}
    block = 16 * 32 * 8 * 128 * 2 * 2  # bytes: 16 tokens x layers x KV heads x dim x K,V x bf16
    held = {w: max(r["kv_peak_bytes"] for r in run["replay_requests"]) // block
            for w, run in runs.items()}
    assert held[128] <= -(-(4 + 128 - 1 + 64) // 16) < held[4096]
    pre = {w: run["summaries"][0]["metrics"]["preemptions"] for w, run in runs.items()}
    assert pre[128] < pre[4096]


def test_tp_collectives_slow_the_steps_on_a_slow_link(trace_file, tmp_path):
    """The same TP 2 replay over a 1 GB/s link (NVLink: 450) has longer steps: its TPOT grows
    by at least the 64 all-reduces of one decode token (4096 x 2 bytes each) per token."""
    args = ["--model", MODEL, "--device", "H100-SXM", "--tp", "2", "--max-num-seqs", "4"]
    tpot = {}
    for link in ("450", "1"):
        code, text = _run(trace_file, *args, "--link-gbs", link, "--out", tmp_path / link)
        assert code == 0, text
        body = json.loads((tmp_path / link / "results.json").read_text())
        tpot[link] = body["summaries"][0]["tpot_s"]["p50"]
    assert tpot["1"] - tpot["450"] > 64 * 4096 * 2 / 1e9 * (1 - 1 / 450)
