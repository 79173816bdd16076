"""``benchmarks/gpu_check.py --dry-run`` runs its whole flow (every check, every timing loop,
the model half through the engine on the CUDA device's test mode) on CPU tensors under
Triton's interpreter, every check passing; without ``--dry-run`` on a
machine without a GPU it refuses with one error line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[cuda]')")

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.triton


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args],
                          capture_output=True, text=True, timeout=300, env=env, check=False)


def test_the_dry_run_passes_every_check_and_runs_every_timing():
    r = _run("--dry-run")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    checks = [line for line in lines if line.startswith(("ok ", "FAIL "))]
    assert len(checks) == 26 and all(line.startswith("ok ") for line in checks), r.stdout
    assert sum(line.startswith("ok greedy tokens, cuda fp32 vs cpu fp32") for line in lines) == 2
    assert "# times (dry run: the flow, not a measurement)" in lines
    assert sum(line.startswith("decode attention") for line in lines) == 4
    assert sum(line.startswith("int") and "encode" in line for line in lines) == 2
    # the model half through the engine on the CUDA device: TPOT per KV format, batch decode
    # against transformers
    assert sum(line.startswith("TPOT bf16 weights, ") for line in lines) == 3
    assert sum(line.startswith("ledger vs allocator, ") for line in lines) == 3
    assert sum(line.startswith("batch-3 decode") and "transformers" in line
               for line in lines) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_the_real_run_refuses_with_one_error_line():
    r = _run()
    assert r.returncode == 2 and r.stderr.strip().startswith("error: ")
    assert len(r.stderr.strip().splitlines()) == 1 and "--dry-run" in r.stderr
