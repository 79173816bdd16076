"""Batch-1 decode TPOT of the kernel probe's weight formats against each forced alternative
(issue 10: "a benchmark can run the chosen kernels against every forced alternative").

One engine per variant (the probe's choice, then ``KVLEDGER_WEIGHT_FORMAT`` forced to each
format given), all loaded at the start; each prefills its contexts once (prefix caching on), then
rounds interleave the variants so a slow minute of a shared machine falls on all of them alike:
every round decodes ``--new`` greedy tokens after each cached context with each variant. Printed:
per variant and context, the median and the best TPOT over the rounds, and the ratio to the
probe's choice (median). ``--clock cpu`` times a request by this process's CPU time instead (the
CPU time of ``--new`` tokens less that of one, over ``--new`` - 1: the decode steps alone), for a
shared machine where the wall clock measures the share of the CPU the process got (meaningful
at 1 thread). Usage:
python benchmarks/bench_formats.py [--formats int8,int4] [--contexts 512,4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import machine_line, real_text_ids

from kvledger import LLM, SamplingParams


def load(fmt: str | None, threads: int) -> LLM:
    """An engine with the probe's formats (``fmt`` None) or every class forced to ``fmt``."""
    os.environ.pop("KVLEDGER_WEIGHT_FORMAT", None)
    if fmt:
        os.environ["KVLEDGER_WEIGHT_FORMAT"] = fmt
    try:
        return LLM("default", enable_prefix_caching=True, num_threads=threads)
    finally:
        os.environ.pop("KVLEDGER_WEIGHT_FORMAT", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--formats", default="int8,int4,dense",
                    help="forced formats to compare (each for every class it applies to)")
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    print(machine_line(args.threads))
    variants = {"probe": load(None, args.threads)}
    for fmt in args.formats.split(","):
        variants[fmt] = load(fmt, args.threads)
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def request_tpot(llm, ids) -> float:
        if args.clock == "wall":
            return llm.generate([ids], params)[0].tpot_s
        t0 = time.process_time()
        llm.generate([ids], params)
        t1 = time.process_time()
        llm.generate([ids], first)
        return ((t1 - t0) - (time.process_time() - t1)) / (args.new - 1)

    prompts = {ctx: real_text_ids(variants["probe"].tokenizer, ctx) for ctx in contexts}
    for name, llm in variants.items():
        print(f"  {name:6s} weights {llm.engine.model.weight_formats}")
        for ids in prompts.values():  # prefill once; later requests hit the prefix cache
            llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
    tpot: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, llm in variants.items():
            for ctx, ids in prompts.items():
                tpot.setdefault((name, ctx), []).append(request_tpot(llm, ids) * 1e3)
    print(f"batch 1, {args.new} new tokens after a cached context, {args.rounds} interleaved "
          f"rounds, {args.clock} clock: TPOT ms, median (best) and median / the probe's")
    for ctx in contexts:
        base = statistics.median(tpot[("probe", ctx)])
        for name in variants:
            got = tpot[(name, ctx)]
            med = statistics.median(got)
            print(f"  context {ctx:5d}  {name:6s} {med:7.1f} ({min(got):6.1f})  {med / base:5.2f}x")


if __name__ == "__main__":
    main()
