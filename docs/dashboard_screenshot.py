"""Screenshot of the live dashboard under load, for the README (docs/dashboard.png).

Start a server first, e.g. ``kvledger serve --kv-cache-gib 0.08 --port 8765``, then run
``python docs/dashboard_screenshot.py http://127.0.0.1:8765 docs/dashboard.png``. It sends eight
concurrent completions (four share a system prompt, so the prefix cache has hits), opens the
dashboard in headless Debian Chromium and saves the page once the requests have run a while.
"""

from __future__ import annotations

import argparse
import threading
import time

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

SHARED = "You are a terse assistant who answers about ships, harbours and the sea. " * 3


def request(url: str, i: int) -> None:
    prompt = (SHARED if i % 2 else "") + f"Tell story number {i} about a lighthouse keeper."
    httpx.post(url + "/v1/completions", timeout=900, json={
        "prompt": prompt, "max_tokens": 80 + 40 * i, "temperature": 0, "ignore_eos": True})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("out")
    parser.add_argument("--after-s", type=float, default=15.0, help="load time before the shot")
    args = parser.parse_args()
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 "--disable-background-networking", "--window-size=1400,1560"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    driver.get(args.url + "/dashboard?interval_ms=500")
    time.sleep(2)
    threads = [threading.Thread(target=request, args=(args.url, i)) for i in range(8)]
    for t in threads:
        t.start()
        time.sleep(0.8)
    time.sleep(args.after_s)
    driver.save_screenshot(args.out)
    driver.quit()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
