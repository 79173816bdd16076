"""Two or more kvledger replicas behind the routers people run, on a multi-tenant
shared-prefix mix: TTFT p50 / p90, throughput, the fleet's prefix hit rate and the KV event lag
per router, with ``kvledger plan --replicas``'s prediction beside each.

Each replica is ``kvledger serve default`` on one thread with a small pool (``--num-blocks``:
room for the prefixes of its own share and its running requests, so where a prefix goes
matters) and KV events on (``fleet_peers.py``). Each router in turn fronts them: vllm-router
round_robin, cache_aware, kv_aware (fed by the replicas' KV events) and kv_aware with the
tenant bound to a replica (``--kv-aware-session-affinity-ttl-secs``; every request carries
its tenant as ``x-session-id``), sglang-router cache_aware. Before each router the replicas'
prefix caches are reset and one request per tenant goes through it, all at once, not counted
(``--warmup``: the run starts from the placement the router chose, not from a burst that no
router has seen an event of). A user's prompt is its tenant's system prompt then its own
question (real text, pydoc topics), ``--concurrency`` at once. Hit rates are the replicas' own
counters (``kvledger:prefix_cache_*``) over the run; the lag is (batch received - first report
in it) at a subscriber on every replica's PUB socket. The plan is ``kvledger plan --device
local --replicas N`` on the same mix and pool, round robin for round robin and prefix-aware
for the others, priced with the step prices measured on the replicas at the start of the run
(``fleet_prices.py``; ``--step-prices model``: the replay's step model, this machine's
``probe --steps`` fit). Writes a JSON report and prints a table.

    python benchmarks/bench_fleet.py --out /tmp/fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import zmq
from common import real_text_ids
from fleet_peers import free_port, router_commands, start_replica, start_router, wait_ready
from fleet_prices import measure
from prometheus_client.parser import text_string_to_metric_families

from kvledger.model.weights.loader import load_tokenizer


def workload(args) -> tuple[list, list]:
    """(one (tenant, prompt) per user, tenants interleaved at random (seeded); one warm-up
    (tenant, prompt) per tenant, its own question): token ids, or their text (``--prompts
    text``: what routers that read text, sglang-router's among them, take)."""
    tok = load_tokenizer("default")
    systems = [real_text_ids(tok, args.prefix_tokens, k * args.prefix_tokens)
               for k in range(args.prefixes)]
    base = args.prefixes * args.prefix_tokens

    def question(u: int) -> list[int]:
        return real_text_ids(tok, args.question_tokens, base + u * args.question_tokens)

    prompts = [(u % args.prefixes, systems[u % args.prefixes] + question(u))
               for u in range(args.users)]
    random.Random(0).shuffle(prompts)
    warmup = [(k, s + question(args.users + k)) for k, s in enumerate(systems)]
    if args.prompts == "ids":
        return prompts, warmup
    return ([(t, tok.decode(p)) for t, p in prompts], [(t, tok.decode(p)) for t, p in warmup])


def counters(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name in ("kvledger:prefix_cache_queries_total", "kvledger:prefix_cache_hits_total"):
                out[s.name.split(":")[1]] = s.value
            elif s.name == "kvledger:request_success_total":
                out["requests"] = out.get("requests", 0) + s.value
    return out


class LagWatch:
    """A SUB socket on every replica's events: (receive time - batch ts) per batch."""

    def __init__(self, endpoints: list[str]) -> None:
        self.lags: list[float] = []
        self.batches = 0
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        for e in endpoints:
            self._sock.connect(e)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decode = msgspec.msgpack.Decoder()
        while not self._stop.is_set():
            if self._sock.poll(100):
                _, _, payload = self._sock.recv_multipart()
                now = time.time()
                self.lags.append(now - decode.decode(payload)[0])
                self.batches += 1

    def take(self) -> list[float]:
        out, self.lags = self.lags, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)


async def _one(client: httpx.AsyncClient, url: str, model: str, tenant: int,
               prompt: list[int] | str, max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    ttft = None
    # the tenant as the session: vllm-router's kv_aware binds it with --kv-aware-session-
    # affinity-ttl-secs; every other router and the replicas ignore the header
    headers = {"x-session-id": f"tenant-{tenant}"}
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data:") and '"text"' in line:
                ttft = time.perf_counter() - start
    return ttft if ttft is not None else float("nan")


async def drive(url: str, model: str, prompts: list, max_tokens: int,
                concurrency: int) -> tuple[list[float], float]:
    """(TTFT of each request, seconds for all) with ``concurrency`` of ``prompts`` ((tenant,
    prompt) each) in flight."""
    queue = list(prompts)
    ttfts = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            while queue:
                ttfts.append(await _one(client, url, model, *queue.pop(0), max_tokens))
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 \
        else values[0]


def plan(args, prices: dict | None, requests: int, rps: float | None = None) -> dict[str, dict]:
    cmd = [sys.executable, "-m", "kvledger", "plan", "default", "--device", "local",
           "--replicas", str(args.replicas), "--prefixes", str(args.prefixes),
           "--prefix-tokens", str(args.prefix_tokens), "--unique-tokens",
           str(args.question_tokens), "--output-tokens", str(args.max_tokens),
           "--fleet-requests", str(requests),
           "--replica-blocks", str(args.num_blocks),
           "--max-num-seqs", str(args.max_num_seqs), "--json"]
    if rps:
        cmd += ["--target-rps", f"{rps:.4f}"]
    if prices:
        cmd += ["--step-prices", json.dumps(prices)]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return {row["routing"]: row for row in out["rows"]} | {"prices": out["prices_source"]}


def run_router(name, cmd, port, replicas, model, prompts, warmup, args, logdir, watch,
               prices) -> dict:
    for r in replicas:
        httpx.post(r.url + "/reset_prefix_cache").raise_for_status()
    router = start_router(name, cmd, port, logdir)
    try:
        time.sleep(2)  # kv_aware: the subscriber connects and replays
        if args.warmup:  # each tenant's prefix placed by the router, all at once, not counted
            asyncio.run(drive(router.url, model, warmup, args.max_tokens, len(warmup)))
            time.sleep(1)  # the events of the warm-up reach the router
        watch.take()
        before = [counters(r.url) for r in replicas]
        ttfts, seconds = asyncio.run(drive(router.url, model, prompts, args.max_tokens,
                                           args.concurrency))
        time.sleep(0.5)
        after = [counters(r.url) for r in replicas]
    finally:
        router.stop()
    lags = watch.take()
    per = [{k: a.get(k, 0) - b.get(k, 0) for k in a} for a, b in zip(after, before)]
    queried = sum(p["prefix_cache_queries_total"] for p in per)
    hits = sum(p["prefix_cache_hits_total"] for p in per)
    rps = len(prompts) / seconds
    routing = "round_robin" if "round_robin" in name else "prefix_aware"
    # the plan's run starts cold: round robin's first misses on each replica (the warm-up's
    # among them); prefix-aware routing took its first misses in the warm-up (steady state)
    cold = 0 if routing == "prefix_aware" and args.warmup else \
        args.users + (args.prefixes if args.warmup else 0)
    predicted = plan(args, prices, cold, rps)
    return {"router": name, "requests": len(prompts), "seconds": seconds, "rps": rps,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p90_s": pct(ttfts, 90),
            "hit_rate": hits / queried if queried else 0.0,
            "per_replica": [{"requests": p.get("requests", 0),
                             "hit_rate": p["prefix_cache_hits_total"]
                             / max(p["prefix_cache_queries_total"], 1)} for p in per],
            "event_lag_p50_ms": 1e3 * pct(lags, 50) if lags else None,
            "event_lag_p99_ms": 1e3 * pct(lags, 99) if lags else None,
            "event_batches": len(lags), "plan": predicted[routing],
            "plan_prices": predicted["prices"]}


def lag_at(replica, model: str, prompts: list, n: int, watch: LagWatch) -> dict:
    """The event lag with ``n`` requests at once on one replica (short prompts)."""
    httpx.post(replica.url + "/reset_prefix_cache").raise_for_status()
    watch.take()
    asyncio.run(drive(replica.url, model, [(t, p[-64:]) for t, p in prompts[:n]], 48, n))
    time.sleep(0.5)
    lags = watch.take()
    return {"concurrent": n, "batches": len(lags), "lag_p50_ms": 1e3 * pct(lags, 50),
            "lag_p99_ms": 1e3 * pct(lags, 99), "lag_max_ms": 1e3 * max(lags)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--prefix-tokens", type=int, default=500)
    ap.add_argument("--users", type=int, default=60)
    ap.add_argument("--question-tokens", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--num-blocks", type=int, default=86)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--prompts", default="text", choices=("text", "ids"),
                    help="send prompts as text or as token ids")
    ap.add_argument("--encoding", default="map", choices=("array", "map"),
                    help="the replicas' KV event layout (--kv-events-config encoding)")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="before each router's run, one request per tenant through it, all at "
                         "once, not counted (the run then starts from the placement it chose)")
    ap.add_argument("--step-prices", default="measured", choices=("measured", "model"),
                    help="the plan's step prices: measured on the replicas in this run "
                         "(fleet_prices.py), or the replay's step model (probe --steps fit)")
    ap.add_argument("--routers", default="", help="comma-separated names to run (default all)")
    ap.add_argument("--logdir", default="/tmp/bench_fleet")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logdir = Path(args.logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    prompts, warmup = workload(args)
    replicas = [start_replica(i, logdir, args.num_blocks, args.max_num_seqs, args.encoding)
                for i in range(args.replicas)]
    results, watch = [], None
    try:
        for r in replicas:
            wait_ready(r, "/health")
        model = httpx.get(replicas[0].url + "/v1/models").json()["data"][0]["id"]
        prices = None
        if args.step_prices == "measured":
            print("== step prices (every replica at once)", flush=True)
            tok = load_tokenizer("default")
            prices = measure([r.url for r in replicas], model,
                             lambda n, offset: real_text_ids(tok, n, offset),
                             args.prefix_tokens, args.prefix_tokens + args.question_tokens,
                             args.max_num_seqs)
            print(json.dumps(prices), flush=True)
        watch = LagWatch([r.extra["events"] for r in replicas])
        port = free_port()
        wanted = [w.strip() for w in args.routers.split(",") if w.strip()]
        for name, cmd in router_commands(replicas, port, 16, model).items():
            if wanted and name not in wanted:
                continue
            print(f"== {name}", flush=True)
            results.append(run_router(name, cmd, port, replicas, model, prompts, warmup, args,
                                      logdir, watch, prices and prices["prices"]))
            print(json.dumps(results[-1]), flush=True)
        lag = lag_at(replicas[0], model, prompts, 16, watch)
    finally:
        if watch is not None:
            watch.close()
        for r in replicas:
            r.stop()
    report = {"args": vars(args), "step_prices": prices, "results": results,
              "event_lag_16": lag}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"{'router':28} {'req/s':>7} {'plan':>7} {'TTFT p50':>9} {'p90':>7} {'plan p90':>9} "
          f"{'hit':>6} {'plan':>6} {'lag p99':>8}")
    for r in results:
        p = r["plan"]
        lag99 = r["event_lag_p99_ms"]
        print(f"{r['router']:28} {r['rps']:7.3f} {p['fleet_rps']:7.3f} {r['ttft_p50_s']:9.2f} "
              f"{r['ttft_p90_s']:7.2f} {p['ttft_p90_s'] or float('nan'):9.2f} "
              f"{r['hit_rate']:6.1%} {p['hit_rate']:6.1%} "
              f"{'-' if lag99 is None else f'{lag99:.1f}':>8}")
    print(f"event lag at {lag['concurrent']} concurrent requests: p50 {lag['lag_p50_ms']:.1f} ms, "
          f"p99 {lag['lag_p99_ms']:.1f} ms over {lag['batches']} batches")


if __name__ == "__main__":
    main()
