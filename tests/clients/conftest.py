"""Fixtures of the client-library tests: a venv with the libraries of ``requirements.txt``
(built once, at ``$KVLEDGER_CLIENTS_VENV`` or ``.venv-clients`` in the checkout; the tests skip
when pip cannot build it, e.g. offline) and one ``kvledger serve`` on the bundled model."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serve_process import ServeProcess, free_port

HERE = Path(__file__).parent
REQUIREMENTS = HERE / "requirements.txt"
SERVE = "import typer; from kvledger.commands.serve import serve; typer.run(serve)"
MODEL = "smollm2"  # --served-model-name: what the clients send as ``model``
BUILD_TIMEOUT_S = 900


def _venv() -> Path:
    default = HERE.parents[1] / ".venv-clients"
    return Path(os.environ.get("KVLEDGER_CLIENTS_VENV", default))


@pytest.fixture(scope="session")
def clients_python() -> str:
    """The clients venv's python (built when missing or when requirements.txt changed)."""
    venv = _venv()
    stamp = venv / ".requirements-sha256"
    want = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()
    python = venv / "bin" / "python"
    if stamp.exists() and stamp.read_text() == want and python.exists():
        return str(python)
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
             [str(python), "-m", "pip", "install", "--quiet", "-r", str(REQUIREMENTS)]]
    for step in steps:
        done = subprocess.run(step, check=False, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            pytest.skip(f"cannot build the clients venv at {venv} (offline?): "
                        f"{(done.stderr or done.stdout)[-500:]}")
    stamp.write_text(want)
    return str(python)


@pytest.fixture(scope="session")
def live(tmp_path_factory) -> tuple[str, str]:
    """``kvledger serve`` on the bundled model: (base URL of its API, served model id)."""
    folder = tmp_path_factory.mktemp("clients")
    port = free_port()
    server = ServeProcess([sys.executable, "-c", SERVE, "--port", str(port), "--state-db",
                           str(folder / "state.sqlite3"), "--served-model-name", MODEL],
                          folder / "server.log", port)
    yield server.url + "/v1", MODEL
    server.close()
