"""Headless Debian Chromium through Selenium, and ``kvledger serve`` in a subprocess.

Tests using these skip (with the reason) when Selenium, ``/usr/bin/chromium`` or
``/usr/bin/chromedriver`` is missing (``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROME_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update",
                "--disable-default-apps", "--disable-sync", "--no-first-run",
                "--metrics-recording-only", "--window-size=1400,1400", "--hide-scrollbars")


def missing_browser() -> str | None:
    """Why no browser test can run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).is_file():
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


def start_chrome():
    """A headless Chromium that records the console and the network (performance log)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def console_errors(driver) -> list[str]:
    """SEVERE console entries since the last call (the log is drained by reading it)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def requested_urls(driver) -> list[str]:
    """URLs of every network request since the last call."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """``kvledger serve`` (bundled model) on a free port with ``args``; ``url``, ``close()``."""

    def __init__(self, log_path: Path, *args: str, command: list[str] | None = None,
                 env: dict | None = None, timeout_s: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = command or [sys.executable, "-m", "kvledger"]
        self._log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until close()
        self.log_path = log_path
        self.proc = subprocess.Popen([*command, "serve", "--port", str(self.port), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.close()
                pytest.fail(f"server exited early:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.close()
        pytest.fail(f"server not ready in {timeout_s} s:\n{log_path.read_text()[-3000:]}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
