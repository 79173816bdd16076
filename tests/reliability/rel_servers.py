"""Fake-engine server processes for the reliability suite (a module of its own name, so that
the tests can import it whatever other test folders are collected alongside)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "server"))

from live_server import free_port


class FakeServerProcess:
    """``serve_fake.py`` in a subprocess: ``url``, ``proc``, ``log_text()``, ``metrics()``."""

    def __init__(self, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, str(HERE / "serve_fake.py"),
                                      str(self.port), *args], stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log_text())
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("fake server did not start:\n" + self.log_text())

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for name, labels, value in re.findall(r"^kvledger:(\w+)(\{[^}]*\})? (\S+)$", text,
                                              re.MULTILINE):
            reason = re.search(r'finished_reason="(\w+)"', labels or "")
            key = f"{name}:{reason.group(1)}" if reason else name
            samples[key] = float(value)
        return samples

    def close(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


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
