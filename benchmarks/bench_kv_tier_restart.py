"""A 4,096-token conversation resumed after a restart: TTFT with the disk KV tier (page cache
warm, and dropped for the block files) against recomputing the prefill (issue 39).

The conversation is ``--context`` tokens of real text (Python's ``pydoc_data.topics``) plus
``--answer`` generated tokens, run once by an engine with ``--kv-disk-dir`` (its full blocks are
written through to the tier; ``close`` waits for the writes). Each trial then builds a fresh
engine (an empty pool, as after a restart; bf16 compute, the default fast mode), runs a short
warm-up request of other text, and times the resumed turn (the conversation plus ``--turn`` new
tokens, one output token) from ``add_request`` to its first token:

* ``recompute``: an engine without the tier prefills everything;
* ``tier, page cache warm``: the block files were just read;
* ``tier, page cache dropped``: ``posix_fadvise(DONTNEED)`` on every block file first.

Every trial starts from a copy of the tier as the conversation left it (a trial's own writes
never help the next). Trials are interleaved; each mode keeps its median. Also printed: the tier's load time and bytes
read for the turn, and the start-up index rebuild time of this tier. A timing figure: run it
alone (``flock /tmp/kvledger-timing.lock /work/bench/quiet.sh python ...``).

    python benchmarks/bench_kv_tier_restart.py [--context 4096] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import machine_line, real_text_ids


def ttft(engine, prompt: list[int]) -> tuple[float, object]:
    """Seconds from add_request to the first token of ``prompt`` (one output token)."""
    from kvledger.engine.sample.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(f"r{start}", prompt, params)
    while True:
        for out in engine.step():
            if out.finished:
                return time.perf_counter() - start, out


def drop_page_cache(root: Path) -> int:
    """posix_fadvise(DONTNEED) on every block file under ``root``; returns their count."""
    files = list(root.rglob("*.kv"))
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


def warm_page_cache(root: Path) -> None:
    for path in root.rglob("*.kv"):
        path.read_bytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--turn", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="tier directory (default: a temporary one)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.engine.sample.sampling_params import SamplingParams

    root = Path(args.dir or tempfile.mkdtemp(prefix="kv-tier-bench-"))
    base = {"model": "default", "dtype": "bf16", "num_blocks": 600}
    tiered = base | {"kv_disk_dir": str(root), "kv_disk_gib": 1.0}
    first = LLMEngine(EngineConfig(**tiered))
    tok = first.tokenizer
    context = real_text_ids(tok, args.context)
    warmup = real_text_ids(tok, 64, offset=args.context + 1000)
    params = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    first.add_request("conversation", context, params)
    while first.has_unfinished_requests():
        for out in first.step():
            answer = out.token_ids
    first.close()
    snapshot = root.with_name(root.name + "-snapshot")  # each trial starts from this tier
    shutil.copytree(root, snapshot, dirs_exist_ok=True)
    resumed = context + answer + real_text_ids(tok, args.turn, offset=args.context + 500)

    modes = {"recompute": base, "tier, page cache warm": tiered,
             "tier, page cache dropped": tiered}
    times: dict[str, list[float]] = {m: [] for m in modes}
    detail: dict[str, dict] = {}
    for _ in range(args.repeats):
        for mode, opts in modes.items():
            shutil.rmtree(root)
            shutil.copytree(snapshot, root)
            engine = LLMEngine(EngineConfig(**opts))
            ttft(engine, warmup)
            if mode.endswith("warm"):
                warm_page_cache(root)
            elif mode.endswith("dropped"):
                drop_page_cache(root)
            seconds, out = ttft(engine, resumed)
            times[mode].append(seconds)
            m = out.metrics
            detail[mode] = {"cached_tokens": m.num_cached_tokens,
                            "cached_tokens_by_tier": m.cached_tokens_by_tier,
                            "tier_load_s": round(m.tier_load_s, 4)}
            if engine.tiers is not None:
                disk = engine.tiers.chain.tiers[-1]
                detail[mode]["index_rebuild_s"] = round(disk.rebuild_seconds, 4)
                detail[mode]["tier_blocks"] = disk.stats.blocks
            engine.close()
    medians = {m: statistics.median(t) for m, t in times.items()}
    print(machine_line(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count()))))
    print(f"resumed turn: {len(resumed)} tokens ({args.context} context + {len(answer)} answer "
          f"+ {args.turn} new), bf16, {args.repeats} trials each, median TTFT")
    for mode, t in medians.items():
        speedup = medians["recompute"] / t
        print(f"  {mode:26s} {t * 1000:9.1f} ms  x{speedup:5.1f}  {detail[mode]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"medians_s": medians, "times_s": times,
                                               "detail": detail}, indent=1))
    shutil.rmtree(snapshot)
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
