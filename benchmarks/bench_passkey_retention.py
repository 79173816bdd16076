"""Pass-key retrieval under each retention policy: a table of depths x policies per context.

Each cell is one ``kvledger eval passkey --json`` run (the product's own command: prefill of
the whole pass-key prompt through the engine, eviction between chunks, greedy answer), so the
table is what a user gets from the CLI. Policies at each budget as in ``bench_retention.py``
(window = budget recent; sinks = 4 + budget - 4; h2o = 4 sinks + budget / 2 recent + heavy
hitters; snapkv = the prompt compressed to budget once it is in). ``--scope prompt`` runs
window / sinks / h2o in kvpress's shape (``--kv-scope prompt``: the prompt compressed once it
is prefilled, the answer's tokens all kept, original positions), as snapkv always is.

``--write-prompts FILE`` runs nothing: it writes the prompts every cell runs (the token ids of
:func:`kvledger.eval.passkey.passkey_prompts`, with depth and key, per context) for
``bench_kvpress.py --passkey FILE``, which must not import kvledger.

Usage: python benchmarks/bench_passkey_retention.py [--contexts 4096,8192] [--depths 10]
       [--budgets 512,1024] [--policies full,window,sinks,h2o,snapkv] [--dtype fp32]
       [--scope always|prompt] [--json out.json] [--write-prompts prompts.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import machine_line


def cli_options(name: str, budget: int | None, scope: str = "always") -> list[str]:
    """The ``--kv-*`` options of one policy at one budget (``full``: none); ``scope`` is
    passed to window / sinks / h2o (snapkv compresses the prompt only in any case)."""
    if name == "full":
        return []
    sizes = {"window": ["--kv-window", str(budget)],
             "sinks": ["--kv-sinks", "4", "--kv-window", str(budget - 4)],
             "h2o": ["--kv-budget", str(budget), "--kv-sinks", "4", "--kv-window", str(budget // 2)],
             "snapkv": ["--kv-budget", str(budget)]}[name]
    scoped = ["--kv-scope", scope] if name != "snapkv" and scope != "always" else []
    return ["--kv-policy", name, *sizes, *scoped]


def depth_arg(depths: list[float]) -> list[float]:
    """The depths as ``--depth`` receives them (3 decimals), so written prompts match runs."""
    return [float(f"{d:.3f}") for d in depths]


def write_prompts(path: str, contexts: list[int], depths: list[float]) -> None:
    """Write ``{"answer_tokens", "prompts": [{"context", "depth", "key", "ids"}]}`` to
    ``path``: every prompt a cell runs (``kvledger eval passkey``'s default seed, one trial
    per depth), tokenized by the engine's tokenizer of the bundled model."""
    from kvledger.eval.passkey import ANSWER_TOKENS, passkey_prompts
    from kvledger.model.weights.loader import load_tokenizer

    tok = load_tokenizer("default")
    prompts = [{"context": c, "depth": d, "key": k, "ids": ids}
               for c in contexts for d, k, ids in passkey_prompts(tok, c, depth_arg(depths))]
    with open(path, "w") as f:
        json.dump({"answer_tokens": ANSWER_TOKENS, "prompts": prompts}, f)


def run_cell(context: int, depths: list[float], name: str, budget: int | None,
             threads: int, dtype: str, scope: str = "always") -> dict:
    """One ``kvledger eval passkey`` run; its JSON object plus the wall time."""
    cmd = [sys.executable, "-m", "kvledger", "eval", "passkey", "--context", str(context),
           "--depth", ",".join(map(str, depth_arg(depths))), "--dtype", dtype,
           "--num-threads", str(threads), "--json", *cli_options(name, budget, scope)]
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
    ap.add_argument("--scope", default="always", help="window/sinks/h2o: always or prompt")
    ap.add_argument("--json", default=None)
    ap.add_argument("--write-prompts", default=None, help="write the prompts here, run nothing")
    args = ap.parse_args()
    depths = [i / (args.depths - 1) for i in range(args.depths)] if args.depths > 1 else [0.5]
    if args.write_prompts:
        write_prompts(args.write_prompts, list(map(int, args.contexts.split(","))), depths)
        return
    print(machine_line(args.threads))
    rows = []
    for context in map(int, args.contexts.split(",")):
        for name in args.policies.split(","):
            for budget in [None] if name == "full" else map(int, args.budgets.split(",")):
                r = run_cell(context, depths, name, budget, args.threads, args.dtype,
                             args.scope)
                marks = " ".join("Y" if t["retrieved"] else "." for t in r["trials"])
                rows.append({"context": context, "policy": name, "budget": budget,
                             "scope": args.scope, **r})
                print(f"{context:6d} {name:7s} {budget or '-':>5}: {marks}  "
                      f"{100 * r['accuracy']:.0f} % ({r['seconds']} s)", flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"args": vars(args), "depths": depths, "rows": rows}, f)


if __name__ == "__main__":
    main()
