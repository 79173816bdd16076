"""Soak: ``kvledger serve`` (bundled model) under concurrent streaming load, for the record.

N concurrent streaming clients on loopback for M minutes: mixed prompt lengths, a share of
requests with one of a few shared system prompts (prefix-cache traffic), and a random share of
clients that disconnect early. Every request ends in one of: a full answer (``[DONE]``), a
clear error (HTTP 4xx/5xx with the OpenAI error shape, or one SSE error event), or an abort by
its own client. Afterwards:

- lost = sent - (full + clear errors + own aborts) must be 0, and the server's counters agree:
  ``request_success_total`` over all reasons == requests the server accepted;
- at idle every KV block is free (``kv_blocks_free == kv_blocks_total``, cached ones included)
  and ``kv_bytes_allocated == 0``;
- the server's RSS (``/proc/PID/status`` VmRSS) is sampled every 5 s; growth over the second
  half of the run is reported (target < 5 %), and the peak against a budget of the RSS when the
  server was ready (interpreter, libraries and weights; the pool is mapped lazily) + the KV
  pool's bytes (``kvledger:kv_pool_bytes``) + 512 MiB (issue 61 item 11's target);
- beside each sample, the pool's resident share (``kv_blocks_touched / kv_blocks_total`` of
  its bytes), so the growth is also reported without the pool's first touches, and at ready,
  half time and the end the RSS by kind of mapping (``/proc/PID/smaps``: the main heap, other
  anonymous memory (thread arenas, mmapped chunks), shared anonymous memory (the pool), files);
- the machine's load average at the start and the end (the machine may be shared).

``--mix`` adds requests of other kinds beside the streamed chats, each a share of the requests:
non-streamed completions with ``logprobs`` 5, chats with a ``json_object`` constraint,
non-streamed chats with ``prompt_logprobs`` 2, and ``/tokenize`` calls (the caches of
grammars, detokenizers and logprob buffers the issue names as suspects).

A client that waits longer than ``--read-timeout-s`` for a byte gives up: that counts as an
abort by its own client (the server sees the disconnect and frees the request).

The KV pool is mapped lazily (a page costs RAM on its first write), so RSS also grows while the
prefix cache first spreads over the pool, up to the pool's bytes: that is not a leak. To see a
leak, give the server a pool small enough to be cycled through early (``-- --num-blocks 512``).

Usage: python benchmarks/soak.py [--clients 200] [--minutes 5] [--max-tokens 24] [--mix]
[--read-timeout-s 300] [--out soak.json] [-- SERVE_OPTIONS...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

SERVE = "import typer; from kvledger.commands.serve import serve; typer.run(serve)"
SYSTEMS = [f"You are assistant number {i}. Answer briefly and politely. " * 6 for i in range(3)]
WORDS = ["tea", "river", "lamp", "cloud", "stone", "seven", "orange", "quiet", "window",
         "bridge", "paper"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) / 1024


def smaps_mib(pid: int) -> dict[str, int]:
    """RSS by kind of mapping: ``heap`` (the main arena), ``anon`` (other anonymous memory:
    thread arenas, mmapped chunks), ``shared`` (shared anonymous maps, shown as ``/dev/zero``:
    the KV pool), ``file`` (libraries, mapped files), ``other`` (stack, vdso)."""
    out = {"heap": 0, "anon": 0, "shared": 0, "file": 0, "other": 0}
    kind = "other"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            name = fields[5] if len(fields) > 5 else ""
            kind = ("anon" if not name else "heap" if name == "[heap]"
                    else "shared" if name == "/dev/zero" else "other" if name.startswith("[")
                    else "file")
        elif fields[0] == "Rss:":
            out[kind] += int(fields[1])
    return {k: v // 1024 for k, v in out.items()}


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    pattern = r"^kvledger:(\w+)(\{[^}]*\})? (\S+)$"
    for name, labels, value in re.findall(pattern, text, re.MULTILINE):
        reason = re.search(r'finished_reason="(\w+)"', labels or "")
        key = f"{name}:{reason.group(1)}" if reason else name
        out[key] = out.get(key, 0.0) + float(value)
    return out


def metrics(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def pool_resident_mib(m: dict[str, float]) -> float:
    """The pool's bytes mapped so far (it is mapped on first write), MiB."""
    total = m.get("kv_blocks_total") or 1.0
    return m.get("kv_pool_bytes", 0.0) * m.get("kv_blocks_touched", 0.0) / total / (1 << 20)


def make_body(rng: random.Random, max_tokens: int) -> dict:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 16, 48, 96))))
    messages = [{"role": "user", "content": f"Tell me about {words}."}]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    return {"messages": messages, "max_tokens": rng.randint(4, max_tokens), "stream": True,
            "temperature": 0.7, "seed": rng.randrange(1 << 30)}


MIX = (("completions logprobs", 0.15), ("json_object", 0.1), ("prompt_logprobs", 0.1),
       ("tokenize", 0.05))
"""``--mix``: the share of requests of each other kind (the rest: streamed chats)."""


def other_request(rng: random.Random, max_tokens: int, kind: str) -> tuple[str, dict]:
    """(route, body) of a non-streamed request of ``kind`` (:data:`MIX`)."""
    chat = make_body(rng, max_tokens) | {"stream": False}
    if kind == "completions logprobs":
        prompt = chat["messages"][-1]["content"]
        return "/v1/completions", {"prompt": prompt, "max_tokens": chat["max_tokens"],
                                   "logprobs": 5, "temperature": 0.7}
    if kind == "json_object":
        return "/v1/chat/completions", chat | {"response_format": {"type": "json_object"}}
    if kind == "prompt_logprobs":
        return "/v1/chat/completions", chat | {"prompt_logprobs": 2}
    return "/tokenize", {"messages": chat["messages"]}


def pick_kind(rng: random.Random, mix: bool) -> str | None:
    """A :data:`MIX` kind, or None for a streamed chat."""
    roll = rng.random()
    for kind, share in MIX if mix else ():
        if roll < share:
            return kind
        roll -= share
    return None


async def other(http: httpx.AsyncClient, url: str, rng: random.Random, max_tokens: int,
                kind: str, outcomes: dict) -> None:
    route, body = other_request(rng, max_tokens, kind)
    r = await http.post(url + route, json=body)
    if r.status_code == 200:
        outcomes["full"] += 1
    else:
        outcomes["clear_error" if "error" in r.json() else "unclear"] += 1
        outcomes[f"http_{r.status_code}"] = outcomes.get(f"http_{r.status_code}", 0) + 1


async def client(url: str, rng: random.Random, deadline: float, max_tokens: int,
                 outcomes: dict, latencies: list, timeout_s: float, mix: bool) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=timeout_s)) as http:
        while time.monotonic() < deadline:
            kind = pick_kind(rng, mix)
            if kind is not None:
                outcomes["sent"] += 1
                try:
                    await other(http, url, rng, max_tokens, kind, outcomes)
                except httpx.TimeoutException:
                    outcomes["own_timeout"] += 1
                except httpx.HTTPError as exc:
                    outcomes["transport_error"] += 1
                    outcomes.setdefault("transport_errors", []).append(type(exc).__name__)
                continue
            body = make_body(rng, max_tokens)
            leave_after = rng.randint(1, 4) if rng.random() < 0.2 else None
            outcomes["sent"] += 1
            start = time.perf_counter()
            try:
                async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        ok_shape = "error" in r.json()
                        outcomes["clear_error" if ok_shape else "unclear"] += 1
                        outcomes[f"http_{r.status_code}"] = outcomes.get(
                            f"http_{r.status_code}", 0) + 1
                        continue
                    events, text = 0, ""
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events += 1
                            text = line
                            if leave_after and events >= leave_after:
                                break
                    if leave_after and events >= leave_after and text != "data: [DONE]":
                        outcomes["own_abort"] += 1
                    elif text == "data: [DONE]":
                        outcomes["full"] += 1
                        latencies.append(time.perf_counter() - start)
                    elif '"error"' in text:
                        outcomes["clear_error"] += 1
                    else:
                        outcomes["unclear"] += 1
            except httpx.TimeoutException:
                outcomes["own_timeout"] += 1  # the client gave up: an abort by its own client
            except httpx.HTTPError as exc:
                outcomes["transport_error"] += 1
                outcomes.setdefault("transport_errors", []).append(type(exc).__name__)


async def load(url: str, clients: int, seconds: float, max_tokens: int, pid: int,
               seed: int, read_timeout_s: float, mix: bool) -> dict:
    outcomes = {"sent": 0, "full": 0, "clear_error": 0, "own_abort": 0, "own_timeout": 0,
                "unclear": 0, "transport_error": 0}
    latencies: list[float] = []
    rss: list[tuple[float, float, float]] = []  # (s, RSS, the pool's resident share) MiB
    start = time.monotonic()
    deadline = start + seconds
    half: dict[str, int] = {}

    async def sample_rss() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            while time.monotonic() < deadline:
                m = parse_metrics((await http.get(url + "/metrics")).text)
                rss.append((time.monotonic() - start, rss_mib(pid), pool_resident_mib(m)))
                if not half and time.monotonic() - start >= seconds / 2:
                    half.update(smaps_mib(pid))
                await asyncio.sleep(5)

    rngs = [random.Random(seed * 1000 + i) for i in range(clients)]
    await asyncio.gather(sample_rss(), *(client(url, rngs[i], deadline, max_tokens, outcomes,
                                                latencies, read_timeout_s, mix)
                                         for i in range(clients)))
    return {"outcomes": outcomes, "latencies": latencies, "rss": rss, "smaps_half": half,
            "wall_s": time.monotonic() - start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--read-timeout-s", type=float, default=300.0,
                    help="a client waiting longer than this for a byte gives up (own abort)")
    ap.add_argument("--mix", action="store_true", help="other request kinds beside the chats")
    ap.add_argument("--out", default="soak.json")
    ap.add_argument("serve_options", nargs="*", help="after --: options of kvledger serve")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open("soak-server.log", "w")  # noqa: SIM115 - the server writes until the end
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "--port", str(port),
                             "--log-interval-s", "30", *args.serve_options], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        rss_start, smaps_start = rss_mib(proc.pid), smaps_mib(proc.pid)
        pool_mib = metrics(url).get("kv_pool_bytes", 0.0) / (1 << 20)
        load_start = os.getloadavg()
        run = asyncio.run(load(url, args.clients, args.minutes * 60, args.max_tokens, proc.pid,
                               args.seed, args.read_timeout_s, args.mix))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            idle = metrics(url)
            if idle["num_requests_running"] == 0 and idle["num_requests_waiting"] == 0:
                break
            time.sleep(0.5)
        o = run["outcomes"]
        accepted = o["sent"] - sum(v for k, v in o.items() if k.startswith("http_"))
        served = sum(v for k, v in idle.items() if k.startswith("request_success_total:"))
        lat = sorted(run["latencies"])
        half = [(r, p) for t, r, p in run["rss"] if t >= run["wall_s"] / 2]
        rss_end, pool_end = rss_mib(proc.pid), pool_resident_mib(idle)
        result = {
            "clients": args.clients, "minutes": args.minutes, "max_tokens": args.max_tokens,
            "serve_options": args.serve_options,
            "outcomes": {k: v for k, v in o.items() if k != "transport_errors"},
            "lost": o["sent"] - o["full"] - o["clear_error"] - o["own_abort"] - o["own_timeout"],
            "server_finished": served, "server_accepted_by_client_count": accepted,
            "p50_s": statistics.median(lat) if lat else None,
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
            "idle": {k: idle.get(k) for k in ("kv_blocks_total", "kv_blocks_free",
                                              "kv_blocks_evictable", "kv_bytes_allocated",
                                              "num_requests_running")},
            "rss_mib": {"start": rss_start, "second_half_first": half[0][0] if half else None,
                        "end": rss_end},
            "rss_growth_second_half": (rss_end / half[0][0] - 1) if half else None,
            "rss_without_pool_growth_second_half": (
                (rss_end - pool_end) / (half[0][0] - half[0][1]) - 1) if half else None,
            "pool_resident_mib": {"second_half_first": half[0][1] if half else None,
                                  "end": pool_end},
            "smaps_mib": {"start": smaps_start, "half": run["smaps_half"],
                          "end": smaps_mib(proc.pid)},
            "rss_peak_mib": max(r for _, r, _ in run["rss"]),
            "rss_budget_mib": rss_start + pool_mib + 512, "kv_pool_mib": pool_mib,
            "rss_samples": [(round(t), round(r), round(p)) for t, r, p in run["rss"]],
            "load_average": {"start": load_start, "end": os.getloadavg()},
            "mix": args.mix,
            "log_tracebacks": Path("soak-server.log").read_text().count("Traceback"),
        }
        print(json.dumps(result, indent=2))
        Path(args.out).write_text(json.dumps(result, indent=2))
    finally:
        proc.terminate()
        print("server exit code:", proc.wait(60))
        log.close()


if __name__ == "__main__":
    main()
