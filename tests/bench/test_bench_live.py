"""``kvledger bench`` against our own ``kvledger serve`` on 127.0.0.1 (bundled model).

Prompt lengths far apart (32 vs 1024 tokens) so that "TTFT grows with prompt length", a
property of prefill work (seed §3.3), holds even on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from serve_process import free_port
from typer.testing import CliRunner

from kvledger.cli import app


@pytest.fixture(scope="module")
def live_server():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kvledger.cli import app; app()", "serve", "--port",
         str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"kvledger serve exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("kvledger serve did not become healthy in 180 s")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_sweep_against_kvledger_serve(live_server, tmp_path):
    out = tmp_path / "live"
    result = CliRunner().invoke(app, [
        "bench", "--url", live_server, "--prompt-lens", "32,1024", "--output-len", "8",
        "--requests", "2", "--warmup", "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("results.json", "results.csv", "report.html", "ttft_vs_prompt.png",
                 "tpot_vs_context.png", "throughput_vs_concurrency.png"):
        assert (out / name).stat().st_size > 0, name
    body = json.loads((out / "results.json").read_text())
    assert body["meta"]["token_counts"].startswith("server POST /tokenize")
    assert body["meta"]["server_metrics"] is True
    short, long = body["summaries"]
    assert short["failures"] == 0 and long["failures"] == 0
    # the server prefilled exactly the nominal lengths (template tokens included)
    assert {r["prompt_tokens"] for r in body["requests"]} == {32, 1024}
    assert all(r["output_tokens"] == 8 for r in body["requests"])  # ignore_eos + max_tokens
    assert long["ttft_s"]["p50"] > short["ttft_s"]["p50"]
    # the KV gauge was scraped during the level (its value depends on when the 0.5 s polls fall)
    assert long["metrics"]["kv_usage_peak"] is not None
