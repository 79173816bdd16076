"""The client libraries people point at OpenAI-compatible servers, driven for real against a
live ``kvledger serve`` on the bundled model (docs/clients.md): each script in ``scripts/``
runs in the clients venv (conftest.py) and exits 0 when its checks hold."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).parent / "scripts"
RUN_TIMEOUT_S = 600


@pytest.mark.parametrize("script", ["openai_client", "agents_sdk", "langchain_chat",
                                    "instructor_modes", "litellm_chat"])
def test_client_library(script, clients_python, live):
    done = subprocess.run([clients_python, str(SCRIPTS / f"{script}.py"), *live], check=False,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
