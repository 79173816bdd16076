"""Find levels that sit well above their curve's trend, and explain them with server metrics.

Seed §5.1: TTFT should rise about linearly with prompt length and TPOT with the KV size
(context length); a sudden jump points to memory trouble (preemption, swapping, a full KV
pool), not to compute. Each curve (median per level, one curve per workload and concurrency)
gets a robust straight-line trend, the **repeated-median** fit (Siegel 1982): slope =
median over i of (median over j != i of the slope between points i and j), intercept =
median of ``y - slope x``. It tolerates up to half the points being outliers, so a jump does not
drag the trend toward itself (Theil-Sen's single median does, with 4-5 points).

**Threshold.** A point is flagged when both hold:

1. measured >= ``RATIO`` (1.5) x trend: a jump, not the mild superlinearity of attention
   (TTFT at 4096 tokens is ~1.2x a linear trend on the CPU peers in PEERS.md);
2. measured - trend >= ``SIGMAS`` (3) robust sigmas, sigma = 1.4826 x the median absolute
   deviation of the residuals (floored at 1 % of the median measured value): a jump beyond the
   run's own noise.

At least ``MIN_POINTS`` (4) levels are needed; shorter curves are reported as not checked.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

RATIO = 1.5
SIGMAS = 3.0
MIN_POINTS = 4
KV_FULL = 0.9  # KV usage fraction at which the pool counts as (nearly) full


def repeated_median_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Siegel's repeated-median line ``y = slope x + intercept``.

    Raises:
        ValueError: fewer than 2 distinct x values.
    """
    slopes = []
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        own = [(yj - yi) / (xj - xi) for j, (xj, yj) in enumerate(zip(xs, ys))
               if j != i and xj != xi]
        if own:
            slopes.append(statistics.median(own))
    if not slopes:
        raise ValueError("a line needs at least 2 distinct x values")
    slope = statistics.median(slopes)
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys))
    return slope, intercept


@dataclass
class Anomaly:
    """One point well above its curve's trend."""

    curve: str  # e.g. "TTFT vs prompt length (sweep, c=1)"
    metric: str  # "TTFT" or "TPOT"
    level: str
    x: float
    measured: float
    trend: float
    explanation: str = ""

    @property
    def ratio(self) -> float:
        """measured / trend (inf when the trend is not positive)."""
        return self.measured / self.trend if self.trend > 0 else float("inf")

    def message(self) -> str:
        """One line for the console and the report."""
        head = (f"{self.metric} jumped {self.ratio:.1f}x above trend at {self.x:.0f} tokens "
                f"[{self.level}]: measured {self.measured:.4g} s, trend {self.trend:.4g} s")
        return f"{head}; {self.explanation}" if self.explanation else head


def flag_points(xs: list[float], ys: list[float]) -> list[tuple[int, float]]:
    """Indices of points above the trend by the module's threshold, with their trend value."""
    if len(xs) < MIN_POINTS or len(set(xs)) < 2:
        return []
    slope, intercept = repeated_median_fit(xs, ys)
    trend = [slope * x + intercept for x in xs]
    residuals = [y - t for y, t in zip(ys, trend)]
    center = statistics.median(residuals)
    mad = statistics.median(abs(r - center) for r in residuals)
    sigma = max(1.4826 * mad, 0.01 * abs(statistics.median(ys)), 1e-12)
    return [(i, t) for i, (y, t, r) in enumerate(zip(ys, trend, residuals))
            if r >= SIGMAS * sigma and (t <= 0 or y >= RATIO * t)]


def explain(metrics: dict, others: list[dict], failures: int) -> str:
    """Why a level may have jumped, from its /metrics deltas and peaks vs the other levels."""
    if not metrics.get("available"):
        return "the server exposes no /metrics, so the cause cannot be attributed"
    parts = []
    if metrics.get("preemptions"):
        parts.append(f"{metrics['preemptions']:.0f} preemption(s) happened")
    usage = metrics.get("kv_usage_peak")
    if usage is not None:
        verb = "hit" if usage >= KV_FULL else "peaked at"
        parts.append(f"KV cache usage {verb} {100 * usage:.0f} %")
    waiting = metrics.get("waiting_peak") or 0
    usual = statistics.median([o.get("waiting_peak") or 0 for o in others]) if others else 0
    if waiting > usual:
        parts.append(f"up to {waiting:.0f} request(s) waited in the server queue")
    if failures:
        parts.append(f"{failures} request(s) failed")
    memory = bool(metrics.get("preemptions")) or (usage or 0) >= KV_FULL
    verdict = ("memory pressure is the likely cause" if memory else
               "no preemption or full KV pool: suspect the host (other load, swapping, clocks)")
    return f"during the level {', '.join(parts)}; {verdict}" if parts else verdict


def find_anomalies(summaries: list[dict]) -> tuple[list[Anomaly], list[str]]:
    """Check TTFT vs prompt length (sweep) and TPOT vs context (sweep, chat-growth).

    ``summaries`` are level summaries from :func:`kvledger.bench.stats.summarize_level`.
    Returns the anomalies and notes on curves of 2 to ``MIN_POINTS - 1`` levels (too short to
    check; a single level is no curve and gets no note).
    """
    anomalies, notes = [], []
    for metric, key, x_key, workloads in (
        ("TTFT", "ttft_s", "prompt_tokens_mean", ("sweep",)),
        ("TPOT", "tpot_s", "context_tokens_mean", ("sweep", "chat-growth")),
    ):
        groups: dict[tuple[str, int], list[dict]] = {}
        for s in summaries:
            if s["workload"] in workloads and s[key]["p50"] is not None and s[x_key] is not None:
                groups.setdefault((s["workload"], s["concurrency"]), []).append(s)
        for (workload, c), levels in groups.items():
            axis = "prompt length" if metric == "TTFT" else "context"
            curve = f"{metric} vs {axis} ({workload}, c={c})"
            if len(levels) < MIN_POINTS:
                if len(levels) > 1:
                    notes.append(f"{curve}: not checked for anomalies ({len(levels)} levels, "
                                 f"{MIN_POINTS} needed)")
                continue
            xs = [s[x_key] for s in levels]
            ys = [s[key]["p50"] for s in levels]
            for i, trend in flag_points(xs, ys):
                others = [s["metrics"] for j, s in enumerate(levels) if j != i]
                why = explain(levels[i]["metrics"], others, levels[i]["failures"])
                anomalies.append(Anomaly(curve, metric, levels[i]["level"], xs[i], ys[i],
                                         trend, why))
    return anomalies, notes
