"""The load generators people point at OpenAI-compatible servers, aiperf and guidellm, run for
real against the live ``kvledger serve`` (docs/clients.md): four streamed chat requests of 16
output tokens each, from their own venv (conftest.py). Their result files must count four
requests done, none failed, and 16 output tokens a request (what was asked, with ``ignore_eos``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REQUESTS = 4
OUTPUT_TOKENS = 16
PROMPT_TOKENS = 32
RUN_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The bundled model's tokenizer as files: both tools count tokens with one, and their
    defaults download one (aiperf tiktoken's encoding, guidellm the model id's from the Hub)."""
    from kvledger.model.weights.loader import load_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer("default").save_pretrained(folder)
    return folder


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False,
                          timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_aiperf(loadgen_python, live_server, live, tokenizer_dir, tmp_path):
    out = tmp_path / "aiperf"
    _run([str(Path(loadgen_python).parent / "aiperf"), "profile", "--model", live[1],
          "--url", live_server.url, "--endpoint-type", "chat", "--streaming",
          "--concurrency", "2", "--request-count", str(REQUESTS),
          "--prompt-input-tokens-mean", str(PROMPT_TOKENS), "--prompt-input-tokens-stddev", "0",
          "--prompt-output-tokens-mean", str(OUTPUT_TOKENS),
          "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
          "--tokenizer", str(tokenizer_dir), "--random-seed", "0", "--no-auto-plot",
          "--reset-kv-cache", "--server-profiler", "--ui-type", "none",
          "--output-artifact-dir", str(out)], tmp_path)
    result = json.loads((out / "profile_export_aiperf.json").read_text())
    assert result["request_count"]["avg"] == REQUESTS
    assert result["error_summary"] == [] and not result["was_cancelled"]
    assert result["usage_completion_tokens"]["avg"] == OUTPUT_TOKENS  # the server's usage
    log = live_server.log_text()  # --server-profiler: /start_profile, /stop_profile
    assert "profiler trace written" in log and "External init callback" not in log


def test_guidellm(loadgen_python, live_server, live, tokenizer_dir, tmp_path):
    out = tmp_path / "benchmarks.json"
    _run([str(Path(loadgen_python).parent / "guidellm"), "run",
          "--backend", f"kind=openai_http,target={live_server.url},model={live[1]}",
          "--profile", "kind=synchronous",
          "--constraint", f"kind=max_requests,count={REQUESTS}",
          "--data", (f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                     f"output_tokens={OUTPUT_TOKENS}"),
          "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
          "--output", f"kind=json,path={out}", "--disable-console-interactive"], tmp_path)
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    assert metrics["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                         "total": REQUESTS}
    tokens = metrics["output_token_count"]["successful"]
    assert tokens["min"] == tokens["max"] == OUTPUT_TOKENS
