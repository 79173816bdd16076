"""``kvledger bench`` against a real llama.cpp ``llama-server`` on the bundled GGUF.

Skipped unless ``KVLEDGER_LLAMA_CPP_DIR`` names a folder with a built ``llama-server`` (llama.cpp
built from source with cmake; the same variable the benchmarks read). The fake llama.cpp-shaped server in
``test_bench_client.py`` covers the protocol; this checks the real one: the token counts come
from llama.cpp's own ``/tokenize`` and the server's usage matches the nominal lengths.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from serve_process import ServeProcess, free_port
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.paths import bundled_model_path

LLAMA_DIR = os.environ.get("KVLEDGER_LLAMA_CPP_DIR")
SERVER = Path(LLAMA_DIR or "/nonexistent") / "llama-server"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not SERVER.is_file(), reason="set KVLEDGER_LLAMA_CPP_DIR to a folder with llama-server")]


def test_bench_counts_tokens_with_llama_cpp(tmp_path):
    port = free_port()
    server = ServeProcess([str(SERVER), "-m", str(bundled_model_path()), "--port", str(port),
                           "-t", "2", "-c", "4096", "-np", "2"], tmp_path / "llama.log", port,
                          timeout_s=120)
    try:
        out = tmp_path / "bench"
        result = CliRunner().invoke(app, [
            "bench", "--url", server.url, "--prompt-lens", "32,256", "--output-len", "4",
            "--requests", "2", "--warmup", "1", "--out", str(out)])
    finally:
        server.close()
    assert result.exit_code == 0, result.output
    body = json.loads((out / "results.json").read_text())
    assert body["meta"]["token_counts"] == "server POST /tokenize (llama.cpp)"
    assert sorted(r["prompt_tokens"] for r in body["requests"]) == [32, 32, 256, 256]
    assert all(r["ok"] and r["output_tokens"] == 4 for r in body["requests"])
