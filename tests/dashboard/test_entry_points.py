"""``kvledger --version`` and ``python -m kvledger``: the version is the installed distribution's."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

from typer.testing import CliRunner

from kvledger.cli import app


def project_version() -> str:
    return version("kvledger")


def test_version_option():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0
    assert r.stdout.strip() == f"kvledger {project_version()}"


def test_python_dash_m():
    r = subprocess.run([sys.executable, "-m", "kvledger", "--version"], check=False,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"kvledger {project_version()}"
    r = subprocess.run([sys.executable, "-m", "kvledger", "models", "--json"],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "meta-llama/Llama-3.1-8B" in r.stdout
