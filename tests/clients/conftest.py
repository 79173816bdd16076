"""Fixtures of the client-library tests: a venv with the libraries of ``requirements.txt``
(built once, at ``$KVLEDGER_CLIENTS_VENV`` or ``.venv-clients`` in the checkout), one with the
load generators of ``requirements-loadgen.txt`` (``$KVLEDGER_LOADGEN_VENV`` or
``.venv-loadgen``; they pin packages below the clients'), the tests skipping when pip cannot
build one (e.g. offline), and one ``kvledger serve`` on the bundled model."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from serve_process import ServeProcess, free_port

HERE = Path(__file__).parent
SERVE = "import typer; from kvledger.commands.serve import serve; typer.run(serve)"
MODEL = "smollm2"  # --served-model-name: what the clients send as ``model``
BUILD_TIMEOUT_S = 1800  # .venv-loadgen took 620 s on 2 busy cores


def _venv_python(requirements: Path, variable: str, default: str) -> str:
    """The python of the venv at ``$variable`` (else ``default`` in the checkout) with the
    packages of ``requirements``, built when missing or when that file changed."""
    venv = Path(os.environ.get(variable, HERE.parents[1] / default))
    stamp = venv / ".requirements-sha256"
    want = hashlib.sha256(requirements.read_bytes()).hexdigest()
    python = venv / "bin" / "python"
    if stamp.exists() and stamp.read_text() == want and python.exists():
        return str(python)
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
             [str(python), "-m", "pip", "install", "--quiet", "-r", str(requirements)]]
    for step in steps:
        done = subprocess.run(step, check=False, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            pytest.skip(f"cannot build the venv at {venv} (offline?): "
                        f"{(done.stderr or done.stdout)[-500:]}")
    stamp.write_text(want)
    return str(python)


@pytest.fixture(scope="session")
def clients_python() -> str:
    """The clients venv's python."""
    return _venv_python(HERE / "requirements.txt", "KVLEDGER_CLIENTS_VENV", ".venv-clients")


@pytest.fixture(scope="session")
def loadgen_python() -> str:
    """The load generators' venv's python (aiperf, guidellm)."""
    return _venv_python(HERE / "requirements-loadgen.txt", "KVLEDGER_LOADGEN_VENV",
                        ".venv-loadgen")


@pytest.fixture(scope="session")
def live_server(tmp_path_factory) -> ServeProcess:
    """``kvledger serve`` on the bundled model, serving it as ``MODEL``, with the profiler
    routes on (aiperf's ``--server-profiler``)."""
    folder = tmp_path_factory.mktemp("clients")
    port = free_port()
    server = ServeProcess([sys.executable, "-c", SERVE, "--port", str(port), "--state-db",
                           str(folder / "state.sqlite3"), "--served-model-name", MODEL,
                           "--profile-dir", str(folder / "profiles")],
                          folder / "server.log", port)
    yield server
    server.close()


@pytest.fixture(scope="session")
def live(live_server) -> tuple[str, str]:
    """(base URL of the live server's API, served model id)."""
    return live_server.url + "/v1", MODEL
