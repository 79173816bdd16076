"""Bounded KV in time: TPOT and KV bytes every ``--every`` generated tokens, one long greedy
generation per policy (default: 20,000 tokens under ``sinks`` at budget 1024, and ``full`` up
to the model's context, 8,192 tokens, where it has to stop).

TPOT of a segment = the median wall time of its decode steps (one engine step = one token for
the single request); TPOT *at* a mark = the median of the last ``--at-steps`` steps before it
(the first segment's median mixes in the steps before the budget is reached); KV bytes = the pool's allocated bytes (``engine.stats()``, blocks in use x
bytes per block) and the ledger's bytes for the tokens held, read at the end of each segment.
The claim checked: under sinks both stay flat (TPOT within 10 % of the first segment's),
while full's grow with the sequence. Timing: run on a quiet machine at normal priority.

Usage: python benchmarks/bench_flat_kv.py [--tokens 20000] [--full-tokens 8192] [--every 1000]
       [--budget 1024] [--threads 2] [--dtype fp32|bf16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import machine_line, real_text_ids

from kvledger import LLM, SamplingParams

PROMPT_TOKENS = 64


def generate_timed(engine, prompt: list[int], n: int, every: int, kv_policy,
                   at_steps: int) -> list[dict]:
    """Greedy ``n`` tokens (EOS ignored); one row per ``every`` tokens: median step ms over the
    segment and over its last ``at_steps`` steps, allocated and ledger KV bytes, blocks in use."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, kv_policy=kv_policy)
    engine.add_request("flat", prompt, params)
    engine.step()  # the prefill and the first token
    rows, times, made, s = [], [], 1, engine.stats()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        made += 1
        if engine.has_unfinished_requests():
            s = engine.stats()  # the last in-flight figures (the final step frees the blocks)
        if made % every == 0 or not engine.has_unfinished_requests():
            rows.append({"tokens": made, "tpot_ms": 1e3 * statistics.median(times),
                         "tpot_ms_at": 1e3 * statistics.median(times[-at_steps:]),
                         "kv_bytes_allocated": s["kv_bytes_allocated"],
                         "kv_bytes_predicted": s["kv_bytes_predicted"],
                         "kv_blocks": s["kv_blocks_total"] - s["kv_blocks_free"]})
            print(f"  {made:6d} tokens: TPOT {rows[-1]['tpot_ms']:7.2f} ms (at the mark "
                  f"{rows[-1]['tpot_ms_at']:7.2f}), KV "
                  f"{rows[-1]['kv_bytes_allocated'] / 2**20:8.2f} MiB allocated "
                  f"({rows[-1]['kv_blocks']} blocks), ledger "
                  f"{rows[-1]['kv_bytes_predicted'] / 2**20:8.2f} MiB", flush=True)
            times = []
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--full-tokens", type=int, default=8192 - PROMPT_TOKENS,
                    help="full's run (0 = skip); it cannot pass the context")
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16", help="the engine default")
    ap.add_argument("--at-steps", type=int, default=100,
                    help="steps before each mark whose median is the TPOT at the mark")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm = LLM("default", dtype=args.dtype, num_threads=args.threads, max_num_seqs=1)
    engine = llm.engine
    prompt = real_text_ids(engine.tokenizer, PROMPT_TOKENS)
    print(machine_line(args.threads), f"· {args.dtype}")
    runs = {"sinks": ({"policy": "sinks", "sinks": 4, "window": args.budget - 4}, args.tokens)}
    if args.full_tokens:
        runs["full"] = (None, args.full_tokens)
    out = {}
    for name, (policy, n) in runs.items():
        print(f"{name}: {n} tokens after a {PROMPT_TOKENS}-token prompt", flush=True)
        out[name] = generate_timed(engine, prompt, n, args.every, policy, args.at_steps)
        first, last = out[name][0], out[name][-1]
        print(f"{name}: TPOT last / first segment = {last['tpot_ms'] / first['tpot_ms']:.3f}; "
              f"at the last / first mark = {last['tpot_ms_at'] / first['tpot_ms_at']:.3f}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine_line(args.threads), **out}, f)


if __name__ == "__main__":
    main()
