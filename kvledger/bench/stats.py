"""Percentiles and per-level summaries.

Percentiles use linear interpolation between closest ranks (Hyndman & Fan type 7, numpy's
default): for sorted values ``x[0..n-1]`` and ``p`` in [0, 100], ``h = (n - 1) p / 100`` and
``P = x[floor h] + (h - floor h) (x[floor h + 1] - x[floor h])``.

Failures never enter a latency distribution: a failed request has no TTFT, not a zero one.
Throughput divides the tokens of successful requests by the level's wall time (first arrival
to last response end).
"""

from __future__ import annotations

import math
from dataclasses import asdict

from kvledger.bench.metrics import LevelMetrics
from kvledger.bench.records import Level, RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values`` by linear interpolation (type 7).

    Raises:
        ValueError: ``values`` is empty or ``p`` is outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} outside [0, 100]")
    xs = sorted(values)
    h = (len(xs) - 1) * p / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def summarize(values: list[float]) -> dict[str, float | int | None]:
    """{n, mean, p50, p90, p99} of ``values`` (None entries when there are no values)."""
    out: dict[str, float | int | None] = {"n": len(values)}
    out["mean"] = sum(values) / len(values) if values else None
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(values, p) if values else None
    return out


def _values(records: list[RequestRecord], attr: str) -> list[float]:
    return [getattr(r, attr) for r in records if r.ok and getattr(r, attr) is not None]


def summarize_level(
    level: Level, records: list[RequestRecord], wall_s: float, metrics: LevelMetrics
) -> dict:
    """One level's summary: latency distributions, throughput, failures, server metrics.

    ``wall_s`` is the level's duration in seconds. Returned keys are stable (results.json).
    """
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    prompt_tokens = sum(r.actual_prompt_tokens for r in ok)
    contexts = [r.context_tokens for r in ok if r.context_tokens is not None]
    phases = sorted({r.phase for r in records if r.phase})
    return {
        "level": level.label,
        "workload": level.workload,
        "prompt_len": level.prompt_len,
        "turn": level.turn,
        "concurrency": level.concurrency,
        "requests": len(records),
        "failures": len(records) - len(ok),
        "prompt_tokens_mean": prompt_tokens / len(ok) if ok else None,
        "output_tokens_mean": out_tokens / len(ok) if ok else None,
        "context_tokens_mean": sum(contexts) / len(contexts) if contexts else None,
        "ttft_s": summarize(_values(records, "ttft_s")),
        "ttft_by_phase": {
            phase: summarize(_values([r for r in records if r.phase == phase], "ttft_s"))
            for phase in phases
        } if len(phases) > 1 else None,
        "tpot_s": summarize(_values(records, "tpot_s")),
        "itl_s": summarize([gap for r in ok for gap in r.itl_s]),
        "e2e_s": summarize(_values(records, "e2e_s")),
        "slot_wait_s": summarize([r.slot_wait_s for r in records]),
        "wall_s": wall_s,
        "output_throughput_tok_s": out_tokens / wall_s if wall_s > 0 else None,
        "total_throughput_tok_s": (out_tokens + prompt_tokens) / wall_s if wall_s > 0 else None,
        "request_throughput_s": len(ok) / wall_s if wall_s > 0 else None,
        "metrics": asdict(metrics) | {"prefix_hit_rate": metrics.prefix_hit_rate},
    }
