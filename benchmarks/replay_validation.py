"""Validate ``kvledger replay --device local`` against a measured run of ``kvledger serve``.

1. Starts ``kvledger serve --trace TRACE`` (the bundled model unless ``--model``) on a free
   port with the given engine options.
2. Sends a mixed workload to ``/v1/completions`` (token-id prompts, ``ignore_eos``): Poisson
   arrivals at ``--rate`` requests/s; prompts of 64-2048 tokens, every other one starting
   with a shared 512-token prefix; plus one growing chat whose turns each resend the previous
   prompt followed by 128 new tokens (a new turn is sent when the previous one is answered).
3. Stops the server, then runs ``kvledger replay TRACE --device local --engine-from-trace``,
   which prints its predicted p50/p90 TTFT and TPOT next to the server-side figures the
   trace recorded (the engine's own stamps, as ``/metrics`` defines them) and the error.

Run ``kvledger probe --steps`` first (it fits the local step model), with the serve run's
``--kv-*`` options when they name a retention policy (one fit per policy). Timing figures are only
worth recording on a quiet machine (check ``uptime``). Example::

    python benchmarks/replay_validation.py --rate 0.4 --requests 24 --out /tmp/val \\
        -- --num-blocks 320 --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SHARED_PREFIX = 512
CHAT_TURNS = 4
CHAT_TURN_TOKENS = 128
MODEL_ID = ["default"]  # set from the server's /v1/models


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _send(client, url, prompt, max_tokens):
    body = {"model": MODEL_ID[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    r = await client.post(url, json=body)
    return r.status_code


async def _warm_up(url: str) -> None:
    async with httpx.AsyncClient(timeout=600) as client:
        await _send(client, url, list(range(100, 164)), 4)


async def workload(url: str, rate: float, n: int, seed: int, vocab: int = 40000) -> list[int]:
    """Send the mixed workload; returns the HTTP status of every request."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, vocab) for _ in range(SHARED_PREFIX)]

    def tokens(k):
        return [rng.randrange(100, vocab) for _ in range(k)]

    async with httpx.AsyncClient(timeout=600) as client:
        async def single(at, prompt, out):
            await asyncio.sleep(at)
            return await _send(client, url, prompt, out)

        async def chat(at):
            await asyncio.sleep(at)
            prompt, codes = [], []
            for _ in range(CHAT_TURNS):
                prompt = prompt + tokens(CHAT_TURN_TOKENS)
                codes.append(await _send(client, url, prompt, 32))
            return codes

        jobs, t = [], 0.0
        for i in range(n):
            t += rng.expovariate(rate)
            length = rng.randrange(64, 2049)
            head = shared if i % 2 and length > SHARED_PREFIX else []
            jobs.append(single(t, head + tokens(length - len(head)), rng.randrange(16, 65)))
        jobs.append(chat(rng.uniform(0, t / 2)))
        results = await asyncio.gather(*jobs)
    flat = []
    for r in results:
        flat += r if isinstance(r, list) else [r]
    return flat


def _run_workload(base: str, args) -> None:
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    MODEL_ID[0] = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
    # warm-up (one short request; it is in the trace): the first steps build kernels
    asyncio.run(_warm_up(f"{base}/v1/completions"))
    t0 = time.perf_counter()
    codes = asyncio.run(workload(f"{base}/v1/completions", args.rate, args.requests, args.seed))
    print(f"workload: {len(codes)} requests in {time.perf_counter() - t0:.1f} s, "
          f"statuses {sorted(set(codes))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=0.4)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default="replay-validation")
    ap.add_argument("engine_options", nargs="*", help="after --: options of kvledger serve")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.jsonl"
    port = _free_port()
    cli = [sys.executable, "-m", "kvledger"]
    with (out / "serve.log").open("w") as log:
        server = subprocess.Popen([*cli, "serve", "--model", args.model, "--port", str(port),
                                   "--trace", str(trace), *args.engine_options],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            _run_workload(f"http://127.0.0.1:{port}", args)
        finally:
            server.terminate()
            server.wait(60)
    replay = [*cli, "replay", str(trace), "--device", "local", "--model", args.model,
              "--engine-from-trace", "--out", str(out / "replay")]
    print(" ".join(replay[1:]))
    return subprocess.call(replay)


if __name__ == "__main__":
    raise SystemExit(main())
