"""docs/models.md's walk-through, run as a newcomer would paste it: a Qwen3 with random weights
converted to a Q8_0 GGUF by llama.cpp's converter, sized, generated from and served. Skipped
unless ``KVLEDGER_LLAMA_CPP_SRC`` names a llama.cpp source tree (``convert_hf_to_gguf.py``,
``gguf-py/``), or when pip cannot install sentencepiece (offline)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from serve_process import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
SRC = os.environ.get("KVLEDGER_LLAMA_CPP_SRC")
CLONE = "git clone --depth 1 https://github.com/ggml-org/llama.cpp"
PIP = "pip install --target spm sentencepiece"


def _walkthrough() -> str:
    text = (ROOT / "docs" / "models.md").read_text()
    section = text[text.index("## Walk-through"):]
    return re.search(r"^```bash\n(.*?)^```", section, re.MULTILINE | re.DOTALL).group(1)


def _bash(script: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-e", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1800, check=False)


@pytest.mark.skipif(not SRC, reason="KVLEDGER_LLAMA_CPP_SRC names no llama.cpp source tree")
def test_models_md_walkthrough_serves_a_converted_gguf(tmp_path):
    block = _walkthrough()
    lines = block.splitlines()
    assert lines[0] == "source .venv/bin/activate" and lines[1].startswith(CLONE)
    assert lines[2] == PIP
    port = free_port()
    rest = "\n".join(lines[3:]).replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace(
        "kvledger serve ", f"kvledger serve --port {port} ")
    env = {**os.environ, "PYTHONPATH": str(ROOT),  # this checkout's kvledger
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # the activated venv
    (tmp_path / "llama.cpp").symlink_to(SRC)  # the clone
    if _bash(PIP, tmp_path, env).returncode != 0:
        pytest.skip("pip cannot install sentencepiece here (offline?)")
    done = _bash("trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + rest, tmp_path, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])  # curl's, the last line
    assert answer["model"] == "tiny-qwen3" and answer["usage"]["completion_tokens"] == 8
    # the generate summary: 2 layers x 2 KV heads x 16 dims x (K, V) x 2 B (bf16) = 256 B/token
    assert "tiny-qwen3-q8_0 · bf16" in done.stderr and "256 B/token" in done.stderr
