"""The repository stands alone: a copy of it with nothing beside it passes the ledger tests.

The copy holds the files git tracks (plus new files git does not ignore), so a test or module
that reads a path outside the checkout (the team's reference folder, any sibling folder)
fails there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = (".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache")


def _repository_files() -> list[str]:
    """Paths (relative to the root) of the checkout's files, from git when it is a checkout."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.decode()
        return [p for p in out.split("\0") if p and (ROOT / p).is_file()]
    return [
        str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
        if p.is_file() and not set(p.relative_to(ROOT).parts) & set(LEFT_OUT)
    ]


def test_a_copy_of_the_repository_alone_passes_the_ledger_tests(tmp_path):
    copy = tmp_path / "kvledger-alone"
    files = _repository_files()
    assert "kvledger/data/configs/meta-llama__Llama-3.1-8B.json" in files
    for rel in files:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, copy / rel)
    env = {**os.environ, "PYTHONPATH": str(copy)}
    where = subprocess.run(
        [sys.executable, "-c", "import kvledger; print(kvledger.__file__)"],
        cwd=copy, env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(copy), where
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not slow", "-p", "no:cacheprovider",
         "tests/ledger", "tests/spec", "tests/commands/test_plan.py"],
        cwd=copy, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
