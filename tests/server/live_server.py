"""``kvledger serve`` on the bundled model, in a subprocess on a free loopback port.

The server runs with an API key, a per-request KV quota (so fuzzed requests stay short), a KV
alert threshold and a 1 s engine log period; its log goes to a file the tests can read.
"""

from __future__ import annotations

import sys
from pathlib import Path

from serve_process import ServeProcess, free_port

API_KEY = "test-key"
ADMIN_KEY = "test-admin-key"
KV_QUOTA_TOKENS = 128
KV_ALERT_BYTES = 1_500_000  # > 2 blocks of 16 tokens (737,280 B each, fp32): 33+ tokens alert
SERVE = "import typer; from kvledger.commands.serve import serve; typer.run(serve)"


class LiveServer(ServeProcess):
    """A running server: ``url``, ``headers`` (with a tenant's key), ``admin_headers``,
    ``metrics()``, ``log_text()``."""

    def __init__(self, log_path: Path, startup_timeout_s: float = 300.0) -> None:
        port = free_port()
        self.headers = {"Authorization": f"Bearer {API_KEY}"}
        self.admin_headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        args = ["--port", str(port), "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
                "--max-kv-tokens-per-request",
                str(KV_QUOTA_TOKENS), "--kv-alert-bytes", str(KV_ALERT_BYTES),
                "--log-interval-s", "1", "--dtype", "fp32"]  # exact, and the byte figures above
        super().__init__([sys.executable, "-c", SERVE, *args], log_path, port,
                         timeout_s=startup_timeout_s)
