"""``kvledger serve`` on the bundled model, in a subprocess on a free loopback port.

The server runs with an API key, a per-request KV quota (so fuzzed requests stay short), a KV
alert threshold and a 1 s engine log period; its log goes to a file the tests can read.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key"
KV_QUOTA_TOKENS = 128
KV_ALERT_BYTES = 1_500_000  # > 2 blocks of 16 tokens (737,280 B each, fp32): 33+ tokens alert
SERVE = "import typer; from kvledger.commands.serve import serve; typer.run(serve)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A running server: ``url``, ``headers`` (with the key), ``metrics()``, ``log_text()``."""

    def __init__(self, log_path: Path, startup_timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {API_KEY}"}
        self.log_path = log_path
        args = ["--port", str(self.port), "--api-key", API_KEY, "--max-kv-tokens-per-request",
                str(KV_QUOTA_TOKENS), "--kv-alert-bytes", str(KV_ALERT_BYTES),
                "--log-interval-s", "1"]
        self._log = open(log_path, "w")  # noqa: SIM115 - the subprocess writes to it until close()
        self.proc = subprocess.Popen([sys.executable, "-c", SERVE, *args], stdout=self._log,
                                     stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"server not ready in {timeout_s} s:\n{self.log_text()[-3000:]}")

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics without labels' values other than finished_reason."""
        text = httpx.get(self.url + "/metrics", timeout=10.0).text
        samples = {}
        for name, labels, value in re.findall(r"^kvledger:(\w+)(\{[^}]*\})? (\S+)$", text, re.MULTILINE):
            reason = re.search(r'finished_reason="(\w+)"', labels or "")
            samples[f"{name}:{reason.group(1)}" if reason else name] = float(value)
        return samples

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
