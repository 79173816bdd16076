"""``benchmarks/gpu_check.py --dry-run`` runs its whole flow (every check, every timing loop)
on CPU tensors under Triton's interpreter, every check passing; without ``--dry-run`` on a
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
    assert len(checks) == 24 and all(line.startswith("ok ") for line in checks), r.stdout
    assert "# times (dry run: the flow, not a measurement)" in lines
    assert sum(line.startswith("decode attention") for line in lines) == 4
    assert sum(line.startswith("int") and "encode" in line for line in lines) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_the_real_run_refuses_with_one_error_line():
    r = _run()
    assert r.returncode == 2 and r.stderr.strip().startswith("error: ")
    assert len(r.stderr.strip().splitlines()) == 1 and "--dry-run" in r.stderr
