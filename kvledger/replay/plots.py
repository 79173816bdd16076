"""PNG plots of a replay (matplotlib, Agg backend), embedded in its report.html.

- ``replay_ttft_cdf.png`` / ``replay_tpot_cdf.png``: the distribution of per-request TTFT /
  TPOT, predicted (one line per setting) and, when the trace recorded them, measured live;
- ``replay_timeline.png``: running requests and KV blocks in use after each step.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg")

from kvledger.bench.plots import _save


def _cdf(ax, values, label, style="-"):
    xs = sorted(v for v in values if v is not None)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], style, label=label)


def cdf_plot(predicted: dict[str, list], measured: list | None, metric: str, path: Path):
    """CDF of ``metric`` seconds per request: {setting: values}, measured values or None."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, values in predicted.items():
        _cdf(ax, values, f"predicted {label}")
    if measured:
        _cdf(ax, measured, "measured (trace)", "k--")
    ax.set_xlabel(f"{metric} (s)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def timeline_plot(steps: list[dict], path: Path):
    """Running sequences and tokens computed per step over simulated time."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    t = [s["start_s"] for s in steps]
    ax.step(t, [len(s["chunks"]) for s in steps], where="post", label="sequences in step")
    ax2 = ax.twinx()
    ax2.step(t, [sum(n for _, _, n in s["chunks"]) for s in steps], where="post",
             color="tab:orange", alpha=0.6, label="tokens computed")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("sequences")
    ax2.set_ylabel("tokens")
    fig.legend(fontsize=8, loc="upper right")
    return _save(fig, path)
