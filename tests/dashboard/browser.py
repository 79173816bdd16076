"""Headless Debian Chromium through Selenium, and ``kvledger serve`` in a subprocess.

Tests using these skip (with the reason) when Selenium, ``/usr/bin/chromium`` or
``/usr/bin/chromedriver`` is missing (``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from serve_process import ServeProcess, free_port

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


def served(log_path: Path, *args: str, command: list[str] | None = None,
           env: dict | None = None, timeout_s: float = 300.0) -> ServeProcess:
    """``kvledger serve`` (bundled model) on a free port with ``args``; ``url``, ``close()``."""
    port = free_port()
    command = command or [sys.executable, "-m", "kvledger"]
    return ServeProcess([*command, "serve", "--port", str(port), *args], log_path, port,
                        env=env, timeout_s=timeout_s)
