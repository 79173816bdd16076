"""Fake-engine server processes for the reliability suite (a module of its own name, so that
the tests can import it whatever other test folders are collected alongside)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from serve_process import ServeProcess, free_port

HERE = Path(__file__).resolve().parent


class FakeServerProcess(ServeProcess):
    """``serve_fake.py`` in a subprocess: ``url``, ``proc``, ``log_text()``, ``metrics()``."""

    def __init__(self, log_path: Path, *args: str) -> None:
        port = free_port()
        super().__init__([sys.executable, str(HERE / "serve_fake.py"), str(port), *args],
                         log_path, port, timeout_s=60)


def wait_for(server: FakeServerProcess, name: str, value: float, timeout_s: float = 30) -> dict:
    """Poll /metrics until ``name`` reaches ``value``; return the last samples."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m.get(name, 0) == value or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


SHARED_ARGS = ("--max-model-len", "1000000", "--step-delay-s", "0.002", "header_timeout_s=1",
               "body_timeout_s=0.5", "max_body_bytes=100000", "send_timeout_s=1")
