"""A server in a subprocess on a free loopback port, for the tests that talk to one over HTTP.

One helper for every such test (live ``kvledger serve``, the fake-engine reliability server, the
installed wheel): start, wait until ``/health`` answers 200, read the log, scrape ``/metrics``,
stop with SIGTERM (SIGKILL after a grace period).
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``command`` (which must listen on ``port``) with its output in ``log_path``.

    Raises:
        RuntimeError: the process exits before ``/health`` answers, or it does not answer
            within ``timeout_s`` seconds (the last 3,000 characters of its log are in the message).
    """

    def __init__(self, command: list[str], log_path: Path, port: int, *,
                 env: dict | None = None, timeout_s: float = 300.0) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until close()
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"server exited early:\n{self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"server not ready in {timeout_s} s:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        """Everything the server wrote so far."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` samples by name; a ``finished_reason`` label becomes ``name:reason``."""
        text = httpx.get(self.url + "/metrics", timeout=10.0).text
        samples: dict[str, float] = {}
        for name, labels, value in re.findall(r"^kvledger:(\w+)(\{[^}]*\})? (\S+)$", text,
                                              re.MULTILINE):
            reason = re.search(r'finished_reason="(\w+)"', labels or "")
            samples[f"{name}:{reason.group(1)}" if reason else name] = float(value)
        return samples

    def close(self) -> int | None:
        """SIGTERM, then SIGKILL after 20 s; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
