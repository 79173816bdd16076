"""How long ``/health`` waits beside heavy requests, and the RSS a prompt-logprobs request
leaves behind (issue 61 items 8 and 9), on ``kvledger serve`` with the bundled model.

One server on 127.0.0.1; each case runs while a prober times ``GET /health`` every 20 ms and
reports the slowest answer:

- ``echo``: one 4,000-token prompt with ``echo``, ``logprobs`` 20 and ``prompt_logprobs`` 20,
  with a 1-token request sent 0.5 s into it (its latency: its TTFT) and the server's RSS
  before, at its peak (sampled every 20 ms) and 3 s after;
- ``echo x 64``: the same prompt 64 times in one request (over the default
  ``--max-prompt-logprob-entries``: refused);
- ``5,000 tools``: a chat request declaring 5,000 functions (``tool_choice: none``);
- ``first structured``: the server's first ``json_object`` request;
- ``detokenize``: ``/detokenize`` of 1.5 M ids.

``--cases echo,detokenize`` runs only those (names: ``structured``, ``echo``, ``echo64``,
``tools``, ``detokenize``). Compare the short request's TTFT with ``-- --new-prefill-tokens 0``
(the scheduling before issue 61's fix: it waited for the long prompt's last chunk).

Usage: python benchmarks/health_stalls.py [--out stalls.json] [--cases ...] [-- SERVE_OPTIONS...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from soak import SERVE, free_port, rss_mib

PROMPT_TOKENS = 4000
PROBE_EVERY_S = 0.02


class Prober:
    """Times ``/health`` (and samples the server's RSS) in a thread until stopped."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid, self.waits, self.rss = url, pid, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                client.get(self.url + "/health")
                self.waits.append(time.perf_counter() - start)
                self.rss.append(rss_mib(self.pid))
                time.sleep(PROBE_EVERY_S)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"health_max_s": round(max(self.waits), 3), "probes": len(self.waits),
                "rss_peak_mib": round(max(self.rss))}


def case(url: str, pid: int, send) -> dict:
    """Run ``send(client) -> dict`` beside the prober; its figures and the prober's."""
    prober = Prober(url, pid)
    time.sleep(0.2)
    with httpx.Client(timeout=600) as client:
        start = time.perf_counter()
        result = send(client)
        result["wall_s"] = round(time.perf_counter() - start, 2)
    time.sleep(0.2)
    return {**result, **prober.stop()}


def echo_body(ids: list, n: int = 1) -> dict:
    return {"prompt": ids if n == 1 else [ids] * n, "max_tokens": 1, "echo": True,
            "logprobs": 20, "prompt_logprobs": 20, "temperature": 0}


def echo_case(url: str, pid: int, ids: list[int]) -> dict:
    def send(client):
        ttft = {}

        def short() -> None:
            time.sleep(0.5)
            start = time.perf_counter()
            with httpx.Client(timeout=600) as other:
                other.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
            ttft["s"] = round(time.perf_counter() - start, 2)

        side = threading.Thread(target=short)
        side.start()
        r = client.post(url + "/v1/completions", json=echo_body(ids))
        side.join()
        return {"status": r.status_code, "bytes": len(r.content), "short_ttft_s": ttft["s"]}

    before = rss_mib(pid)
    result = case(url, pid, send)
    time.sleep(3)
    return {**result, "rss_before_mib": round(before), "rss_after_mib": round(rss_mib(pid))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cases", default="structured,echo,echo64,tools,detokenize")
    args, serve_args = parser.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "--host", "127.0.0.1", "--port",
                             str(port), "--max-body-bytes", str(32 << 20), *serve_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        rng = random.Random(0)
        ids = [rng.randrange(100, 40000) for _ in range(PROMPT_TOKENS)]
        tools = [{"type": "function", "function": {
            "name": f"tool_{i}", "description": f"Tool number {i}.", "parameters": {
                "type": "object", "properties": {"x": {"type": "integer"}}}}}
            for i in range(5000)]
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
        cases = {
            "first structured": ("structured", lambda: case(url, proc.pid, lambda c: {
                "status": c.post(url + "/v1/chat/completions", json={
                    **chat, "response_format": {"type": "json_object"}}).status_code})),
            "echo": ("echo", lambda: echo_case(url, proc.pid, ids)),
            "echo x 64": ("echo64", lambda: case(url, proc.pid, lambda c: {"status": c.post(
                url + "/v1/completions", json=echo_body(ids, 64)).status_code})),
            "5,000 tools": ("tools", lambda: case(url, proc.pid, lambda c: {"status": c.post(
                url + "/v1/chat/completions",
                json={**chat, "tools": tools, "tool_choice": "none"}).status_code})),
            "detokenize": ("detokenize", lambda: case(url, proc.pid, lambda c: {
                "status": c.post(url + "/detokenize", json={"tokens": ids * 375}).status_code})),
        }
        wanted = args.cases.split(",")
        results = {name: run() for name, (key, run) in cases.items() if key in wanted}
        results["load_average"] = os.getloadavg()
    finally:
        proc.terminate()
        proc.wait(30)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
