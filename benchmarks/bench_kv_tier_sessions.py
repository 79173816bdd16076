"""Many conversations over a pool too small for them, with and without the disk KV tier
(issue 39): throughput, TTFT p50/p99, cached tokens per tier, dropped writes; and decode TPOT
while the tier's writes stream, against the tier off.

Sessions: ``--sessions`` conversations of ``--turns`` turns, each turn ``--user`` new tokens of
real text (Python's ``pydoc_data.topics``, a different range per session and turn) and
``--answer`` generated tokens (greedy, EOS ignored), interleaved round-robin: every session's
turn t is queued, then the engine runs until all finish, then turn t + 1. The pool
(``--pool-sessions`` sessions' final KV) cannot hold them all, so without a tier most history
is prefilled again at every turn. bf16 compute, the bundled model, one engine per mode.

Predicted against measured load time: before the tier's run the bench probes the tier
directory's read speed (cold and warm) and the engine's prefill speed as ``kvledger probe
--kv-disk-dir`` does, and saves them (in a scratch config folder) for the engine, which then
predicts each load (``kv_tier_load_predicted_seconds``) and measures it
(``kv_tier_load_seconds``); reported: median |predicted - measured| / measured over the
requests that loaded, and the prediction's median ratio to the measurement.

TPOT: ``--tpot-batch`` fresh prompts of ``--user`` tokens decode ``--answer`` tokens; the median
time of the steps in which every request decodes (the tier's writes of the prompts' blocks and of
each block the decode fills stream meanwhile), tier on against off, interleaved, ``--repeats``
runs each. Run it alone (flock + quiet.sh).

    python benchmarks/bench_kv_tier_sessions.py [--sessions 16] [--turns 4] [--user 128]
        [--answer 64] [--pool-sessions 4] [--repeats 3 (0: no TPOT part)] [--json OUT]
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


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run_sessions(engine, tok, args) -> dict:
    from kvledger.engine.sample.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    history = [[] for _ in range(args.sessions)]
    ttfts, prompt_tokens, by_tier, generated = [], 0, {"pool": 0, "ram": 0, "disk": 0}, 0
    cached, loads = 0, []
    start = time.perf_counter()
    for turn in range(args.turns):
        for s in range(args.sessions):
            offset = (s * args.turns + turn) * args.user
            history[s] = history[s] + real_text_ids(tok, args.user, offset)
            engine.add_request(f"s{s}t{turn}", history[s], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    s = int(out.request_id[1:].split("t")[0])
                    m = out.metrics
                    history[s] = history[s] + out.token_ids
                    ttfts.append(m.ttft_s)
                    prompt_tokens += len(out.prompt_token_ids)
                    cached += m.num_cached_tokens
                    generated += len(out.token_ids)
                    if m.tier_load_s > 0:
                        loads.append((m.tier_load_predicted_s, m.tier_load_s))
                    for k, v in (m.cached_tokens_by_tier or {"pool": m.num_cached_tokens}).items():
                        by_tier[k] += v
    wall = time.perf_counter() - start
    stats = engine.stats()
    errors = [abs(p - t) / t for p, t in loads]
    return {"wall_s": wall, "output_tok_per_s": generated / wall,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "hit_rate_by_tier": {k: v / prompt_tokens for k, v in by_tier.items()},
            "dropped_writes": stats.get("kv_tier_dropped_writes", 0),
            "offered_writes": stats.get("kv_tier_offered_writes", 0),
            "recomputed_blocks": stats.get("kv_tier_recomputed_blocks", 0),
            "tier_blocks_loaded": sum(t["hits"] for t in stats.get("kv_tiers", {}).values()),
            "deferred_loads": stats.get("kv_tier_deferred_loads", 0),
            "preemptions": stats["num_preemptions"],
            "loads": len(loads),
            "load_error_median": statistics.median(errors) if loads else None,
            "load_predicted_over_measured_median":
                statistics.median(p / t for p, t in loads) if loads else None,
            "load_seconds_measured": sum(t for _, t in loads),
            "load_seconds_predicted": sum(p for p, _ in loads)}


def probe_tier(directory: Path, config: Path) -> dict:
    """What ``kvledger probe --kv-disk-dir`` measures for ``directory`` (the read speeds and
    the bundled model's prefill speed), saved where the engine reads it (``config``)."""
    from kvledger.commands.probe import prefill_speed
    from kvledger.engine.kv.tiers.read_probe import measure_read, store_tensor_bytes
    from kvledger.ledger.tier_load import save_figures
    from kvledger.model.families import load_spec

    directory.mkdir(parents=True, exist_ok=True)
    figures = (measure_read(directory, store_tensor_bytes(load_spec("default")))
               | prefill_speed("default"))
    save_figures(directory, figures, config)
    return figures


def decode_tpot(engine, tok, args, offset: int) -> float:
    from kvledger.engine.sample.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.answer, temperature=0.0, ignore_eos=True)
    for i in range(args.tpot_batch):
        engine.add_request(f"d{offset}-{i}", real_text_ids(tok, args.user, offset + i * args.user),
                           params)
    steps = []
    while engine.has_unfinished_requests():
        decoding = len(engine.scheduler.running) == args.tpot_batch and all(
            r.num_uncomputed_tokens == 1 for r in engine.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if decoding:
            steps.append(time.perf_counter() - start)
    return statistics.median(steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user", type=int, default=128)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--pool-sessions", type=int, default=4)
    ap.add_argument("--tpot-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine

    final = args.turns * (args.user + args.answer)
    blocks = args.pool_sessions * -(-final // 16)
    root = Path(tempfile.mkdtemp(prefix="kv-tier-sessions-"))
    modes = {"tier off": {}, "disk tier": {"kv_disk_dir": str(root / "s"), "kv_disk_gib": 2.0}}
    print(machine_line(os.cpu_count()))
    print(f"{args.sessions} sessions x {args.turns} turns, {args.user}-token user turns, "
          f"{args.answer}-token answers, pool {blocks} blocks ({args.pool_sessions} sessions' "
          "final KV), bf16")
    os.environ["KVLEDGER_CONFIG_DIR"] = str(root / "config")
    figures = probe_tier(root / "s", root / "config")
    print(f"  probed: {json.dumps(figures, default=str)}")
    results = {}
    for mode, extra in modes.items():
        engine = LLMEngine(EngineConfig(model="default", dtype="bf16", num_blocks=blocks, **extra))
        results[mode] = run_sessions(engine, engine.tokenizer, args)
        engine.close()
        print(f"  {mode:10s} {json.dumps(results[mode], default=lambda x: round(x, 4))}")
    if args.repeats <= 0:
        _save(args, results, {}, figures)
        shutil.rmtree(root)
        return
    tpot = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in modes:
            shutil.rmtree(root / "t", ignore_errors=True)
            extra = {"kv_disk_dir": str(root / "t")} if mode != "tier off" else {}
            engine = LLMEngine(EngineConfig(model="default", dtype="bf16", num_blocks=blocks,
                                            **extra))
            tpot[mode].append(decode_tpot(engine, engine.tokenizer, args, 50_000 + r * 5_000))
            engine.close()
    med = {m: statistics.median(v) for m, v in tpot.items()}
    print(f"  decode TPOT, batch {args.tpot_batch}, median of {args.repeats}: " + ", ".join(
        f"{m} {v * 1000:.1f} ms" for m, v in med.items()) +
        f" ({(med['disk tier'] / med['tier off'] - 1) * 100:+.1f} % with the tier)")
    _save(args, results, tpot, figures)
    shutil.rmtree(root)


def _save(args, results: dict, tpot: dict, figures: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps({"sessions": results, "tpot_s": tpot,
                                               "probed": figures}, indent=1))


if __name__ == "__main__":
    main()
