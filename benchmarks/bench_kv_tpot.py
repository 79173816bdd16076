"""Decode time per output token (TPOT) at batch 8 over 4K-token contexts, per KV format.

Issue 11's timing target: int8 KV's TPOT <= bf16 KV's (the decode step reads the whole KV of
every running sequence; int8 reads about half of bf16's bytes, and the kernel dequantizes per
block inside its loop). For each format, one engine (bf16 compute, the default fast mode, the
attention backend the kernel probe picks for that format) takes ``--batch`` prompts of
``--context`` tokens of real text (Python's ``pydoc_data.topics``, different offsets, so no
shared prefix) and decodes ``--new`` tokens greedily with EOS ignored; later repeats find the
prompts in the prefix cache (prefill is not what is measured). Prefill is not timed:
every engine step after all requests have their first token is a pure decode step of
``--batch`` sequences, timed on its own; TPOT = the median of those step times (every request
gets one token per step). ``--repeats`` runs per format, interleaved across formats, and each
format keeps the median of its runs' medians. Next to it, the floor: the step's weight bytes and
the batch's KV bytes at the mid-decode context, read at the bandwidth ``kvledger probe`` measured.

A timing figure: run it on a quiet machine (``uptime`` load < 1.5), unniced, and say the load.

    python benchmarks/bench_kv_tpot.py [--context 4096] [--batch 8] [--new 32]
        [--formats bf16,int8,int4,fp8] [--repeats 3] [--threads 2] [--attention NAME]
        [--json OUT]

A format may name a rotation after a ``+`` and a key group, window and intact tokens after
``/``: ``int4+hadamard`` (``--kv-rotation``), ``int2+hadamard/G64/R128/N64``
(``--kv-key-group-tokens 64 --kv-residual-tokens 128 --kv-intact-tokens 64``). The table names the backend that reads each format's KV (the
native kernel, or paged-torch for the layers it hands over: ``AttentionBackend.reader``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch
from common import decode_step_times, machine_line, real_text_ids, tpot_floor_ms


def decode_steps(engine, prompts: list[list[int]], new: int) -> list[float]:
    """Seconds of each engine step in which every request of ``prompts`` decodes one token."""
    from kvledger.engine.sample.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    return decode_step_times(engine, prompts, [params] * len(prompts))


def format_options(label: str) -> dict:
    """Engine options of a format label: ``name[+rotation][/G<tokens>][/R<tokens>][/N<tokens>]``."""
    head, *sizes = label.split("/")
    name, _, rotation = head.partition("+")
    options = {"kv_cache_dtype": name, "kv_rotation": rotation or "none"}
    for size in sizes:
        key = {"G": "kv_key_group_tokens", "R": "kv_residual_tokens",
               "N": "kv_intact_tokens"}[size[0]]
        options[key] = int(size[1:])
    return options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=32, help="output tokens per request")
    ap.add_argument("--formats", default="bf16,int8,int4,fp8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention", help="attention backend (default: the kernel probe's pick)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    print(machine_line(args.threads), "· bf16 compute · load", os.getloadavg()[0])
    spec, weights = load_weights("default", torch.bfloat16)
    tokenizer = load_tokenizer("default")
    prompts = [real_text_ids(tokenizer, args.context, offset=i * args.context)
               for i in range(args.batch)]
    blocks = args.batch * (-(-(args.context + args.new) // 16) + 1)
    engines = {}
    for fmt in formats:
        cfg = EngineConfig(dtype="bf16", num_blocks=blocks, max_num_seqs=args.batch,
                           num_threads=args.threads, attention=args.attention,
                           **format_options(fmt))
        engines[fmt] = LLMEngine(cfg, spec=spec, weights=weights, tokenizer=tokenizer)
    runs = {fmt: [] for fmt in formats}
    for _ in range(args.repeats):
        for fmt in formats:  # interleaved: a disturbed moment slows every format alike
            steps = decode_steps(engines[fmt], prompts, args.new)
            runs[fmt].append(statistics.median(steps))
    rows = []
    base = statistics.median(runs[formats[0]])
    for fmt in formats:
        tpot = statistics.median(runs[fmt])
        engine = engines[fmt]
        rows.append({"kv_format": fmt, "layout": engine.kv_layout.describe(),
                     "attention": engine.model.attention.reader(engine.store),
                     "tpot_ms": round(tpot * 1e3, 2),
                     "runs_ms": [round(t * 1e3, 2) for t in runs[fmt]],
                     f"vs_{formats[0]}": round(tpot / base, 3),
                     "kv_bytes_per_token": engine.bytes_per_token})
        kv_read = args.batch * (args.context + args.new // 2) * engine.bytes_per_token
        floor = tpot_floor_ms(engine.model.decode_weight_bytes, kv_read)
        rows[-1]["floor_ms"] = None if floor is None else round(floor, 2)
        print(f"{fmt:22s} TPOT {tpot * 1e3:8.2f} ms  ({tpot / base:.3f}x {formats[0]})  "
              f"floor {floor or float('nan'):.2f} ms  "
              f"runs {rows[-1]['runs_ms']}  backend {rows[-1]['attention']}  "
              f"{engine.kv_layout.describe()}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_line(args.threads),
                                         "context": args.context, "batch": args.batch,
                                         "new": args.new, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
