"""Every Triton kernel variant of the CUDA device compiles to an sm_90 (H100) cubin here,
without a GPU (``compile_for_gpu.py``: Triton's lowering and its bundled ptxas), so the kernels
the interpreter runs are also kernels a GPU can load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[cuda]')")

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.triton


def test_every_kernel_compiles_to_an_sm90_cubin(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_for_gpu.py"))],
                       capture_output=True, text=True, timeout=600, env=env, check=False)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert len(lines) == 21 and all(line.startswith("ok ") for line in lines), r.stdout
