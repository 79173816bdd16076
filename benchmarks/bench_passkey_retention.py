"""Pass-key retrieval under each retention policy: a table of depths x policies per context.

Each cell is one ``kvledger eval passkey --json`` run (the product's own command: prefill of
the whole pass-key prompt through the engine, eviction between chunks, greedy answer), so the
table is what a user gets from the CLI. Policies at each budget as in ``bench_retention.py``
(window = budget recent; sinks = 4 + budget - 4; h2o = 4 sinks + budget / 2 recent + heavy
hitters; snapkv = the prompt compressed to budget once it is in).

Usage: python benchmarks/bench_passkey_retention.py [--contexts 4096,8192] [--depths 10]
       [--budgets 512,1024] [--policies full,window,sinks,h2o,snapkv] [--dtype fp32]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import machine_line


def cli_options(name: str, budget: int | None) -> list[str]:
    """The ``--kv-*`` options of one policy at one budget (``full``: none)."""
    if name == "full":
        return []
    sizes = {"window": ["--kv-window", str(budget)],
             "sinks": ["--kv-sinks", "4", "--kv-window", str(budget - 4)],
             "h2o": ["--kv-budget", str(budget), "--kv-sinks", "4", "--kv-window", str(budget // 2)],
             "snapkv": ["--kv-budget", str(budget)]}[name]
    return ["--kv-policy", name, *sizes]


def run_cell(context: int, depths: list[float], name: str, budget: int | None,
             threads: int, dtype: str) -> dict:
    """One ``kvledger eval passkey`` run; its JSON object plus the wall time."""
    cmd = [sys.executable, "-m", "kvledger", "eval", "passkey", "--context", str(context),
           "--depth", ",".join(f"{d:.3f}" for d in depths), "--dtype", dtype,
           "--num-threads", str(threads), "--json", *cli_options(name, budget)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]),
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,8192")
    ap.add_argument("--depths", type=int, default=10, help="evenly spaced in [0, 1]")
    ap.add_argument("--budgets", default="512,1024")
    ap.add_argument("--policies", default="full,window,sinks,h2o,snapkv")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32", help="compute dtype of every cell (fp32, bf16)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    depths = [i / (args.depths - 1) for i in range(args.depths)] if args.depths > 1 else [0.5]
    print(machine_line(args.threads))
    rows = []
    for context in map(int, args.contexts.split(",")):
        for name in args.policies.split(","):
            for budget in [None] if name == "full" else map(int, args.budgets.split(",")):
                r = run_cell(context, depths, name, budget, args.threads, args.dtype)
                marks = " ".join("Y" if t["retrieved"] else "." for t in r["trials"])
                rows.append({"context": context, "policy": name, "budget": budget, **r})
                print(f"{context:6d} {name:7s} {budget or '-':>5}: {marks}  "
                      f"{100 * r['accuracy']:.0f} % ({r['seconds']} s)", flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"args": vars(args), "depths": depths, "rows": rows}, f)


if __name__ == "__main__":
    main()
