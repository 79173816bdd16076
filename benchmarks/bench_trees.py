"""Did a change make the engine slower? The same measurement on two or more checkouts.

Each round runs, for every checkout in turn, a fresh process with that checkout first on
``PYTHONPATH`` (so its ``kvledger`` is imported) and this script's prompts (real text,
:func:`common.real_text_ids`, identical for every checkout): batch-1 TTFT and TPOT at a
512-token prompt (``--prompt``) + 64 new tokens (median of 3 requests), and the output rate
of 16 prompts of 256 tokens + 32 new tokens in one ``generate`` call. Rounds interleave the checkouts so that a
disturbed moment slows all of them alike; the table shows each figure's median over rounds.

Usage: python benchmarks/bench_trees.py BEFORE_DIR AFTER_DIR [--dtype fp32] [--rounds 3]
[--prompt 512] [--options '{"kv_cache_dtype": "int4"}'] (``--options``: engine options, as
``LLM(**options)`` takes them, the same for every checkout)
(a checkout of an older commit: ``git worktree add --detach /tmp/before <commit>``). Only
``LLM``, ``SamplingParams`` and ``RequestOutput.metrics`` of the checkouts are used, so old
commits work too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, statistics, sys, time
import torch
sys.path.insert(0, {bench_dir!r})
from common import real_text_ids
from kvledger import LLM, SamplingParams
torch.set_num_threads({threads})
llm = LLM("default", dtype={dtype!r}, **{options!r})
tok = llm.tokenizer
greedy = dict(temperature=0.0, ignore_eos=True)
llm.generate([real_text_ids(tok, 64, offset=9000)], SamplingParams(max_tokens=4, **greedy))
runs = [llm.generate([real_text_ids(tok, {prompt}, offset=1000 * (i + 1))],
                     SamplingParams(max_tokens=64, **greedy))[0] for i in range(3)]
batch = [real_text_ids(tok, 256, offset=5000 + 300 * i) for i in range(16)]
t = time.perf_counter()
outs = llm.generate(batch, SamplingParams(max_tokens=32, **greedy))
dt = time.perf_counter() - t
import kvledger
print(json.dumps({{"kvledger": kvledger.__file__, "ttft_ms": 1e3 * statistics.median(o.metrics.ttft_s for o in runs),
                   "tpot_ms": 1e3 * statistics.median(o.tpot_s for o in runs),
                   "batch16_tok_s": sum(len(o.token_ids) for o in outs) / dt}}))
"""
FIGURES = ("ttft_ms", "tpot_ms", "batch16_tok_s")


def measure(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    """One fresh process on ``tree``'s kvledger; its figures (ms, ms, output tokens/s)."""
    code = CHILD.format(bench_dir=str(Path(__file__).parent), dtype=args.dtype,
                        threads=args.threads, options=json.loads(args.options),
                        prompt=args.prompt)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=tree)  # cwd leads sys.path under -c: the tree's own
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(result.pop("kvledger")).is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: imported another checkout's kvledger")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", type=Path, help="checkouts to compare, first = baseline")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512, help="batch-1 prompt tokens")
    ap.add_argument("--options", default="{}", help="engine options as JSON, for every checkout")
    args = ap.parse_args()
    runs: dict[Path, list[dict]] = {t: [] for t in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            runs[tree].append(measure(tree, args))
            print(f"round {r + 1} {tree}: {json.dumps(runs[tree][-1])}", flush=True)
    base = {f: statistics.median(x[f] for x in runs[args.trees[0]]) for f in FIGURES}
    print(f"\nmedians over {args.rounds} rounds, {args.dtype}, {args.threads} threads, "
          f"prompt {args.prompt}, options {args.options} (change vs the first checkout)")
    print(f"{'checkout':40s} " + " ".join(f"{f:>22s}" for f in FIGURES))
    for tree in args.trees:
        cells = []
        for f in FIGURES:
            m = statistics.median(x[f] for x in runs[tree])
            cells.append(f"{m:10.2f} ({100 * (m / base[f] - 1):+6.1f} %)")
        print(f"{tree!s:40s} " + " ".join(f"{c:>22s}" for c in cells))


if __name__ == "__main__":
    main()
