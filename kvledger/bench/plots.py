"""PNG plots of the measured curves (matplotlib, Agg backend: no display needed).

- ``ttft_vs_prompt.png``: median TTFT (p90 dashed) vs prompt tokens, one line per concurrency,
  ledger TTFT floor dotted when an overlay is given, anomalies circled in red;
- ``tpot_vs_context.png``: median TPOT vs mean decode context (prompt + output/2), sweep and
  chat-growth lines, ledger TPOT floor dotted;
- ``throughput_vs_concurrency.png``: output tokens/s vs concurrency, one line per prompt length;
- ``shared_prefix_ttft.png``: TTFT of the cold first request vs the warm others per prefix.

Each function writes one file and returns its path, or None when there is nothing to plot.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg"): the backend must be chosen first

from kvledger.bench.anomaly import Anomaly


def _series(summaries: list[dict], workload: str, x_key: str, y_key: str, q: str = "p50"):
    """{concurrency: (xs, ys)} of levels of ``workload`` with both values, sorted by x."""
    out: dict[int, tuple[list[float], list[float]]] = {}
    for s in summaries:
        if s["workload"] == workload and s[x_key] is not None and s[y_key][q] is not None:
            xs, ys = out.setdefault(s["concurrency"], ([], []))
            xs.append(s[x_key])
            ys.append(s[y_key][q])
    return {c: tuple(map(list, zip(*sorted(zip(xs, ys))))) for c, (xs, ys) in out.items()}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _curve_plot(
    summaries: list[dict], out: Path, workloads: tuple[str, ...], x_key: str, y_key: str,
    metric: str, xlabel: str, floor: list[tuple[float, float]] | None,
    floor_label: str, anomalies: list[Anomaly], unit: str = "s",
) -> Path | None:
    lines = [(w, c, xy) for w in workloads
             for c, xy in _series(summaries, w, x_key, y_key).items()]
    if not lines:
        return None
    k = 1000.0 if unit == "ms" else 1.0
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for workload, c, (xs, ys) in lines:
        (line,) = ax.plot(xs, [k * y for y in ys], "o-", label=f"{workload} c={c} p50")
        p90x, p90y = _series(summaries, workload, x_key, y_key, "p90")[c]
        ax.plot(p90x, [k * y for y in p90y], "--", color=line.get_color(), alpha=0.6,
                label=f"{workload} c={c} p90")
    if floor:
        ax.plot([x for x, _ in floor], [k * y for _, y in floor], ":", color="black",
                label=floor_label)
    marked = [a for a in anomalies if a.metric == metric]
    if marked:
        ax.plot([a.x for a in marked], [k * a.measured for a in marked], "o", ms=14,
                mfc="none", mec="red", mew=2, label="anomaly")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{metric} ({unit})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{metric} vs {xlabel.split(' (')[0]}")
    return _save(fig, out)


def plot_ttft(summaries, out_dir: Path, anomalies, floor=None) -> Path | None:
    """TTFT vs prompt length (sweep); ``floor`` = [(prompt tokens, seconds)] of the ledger."""
    return _curve_plot(summaries, out_dir / "ttft_vs_prompt.png", ("sweep",),
                       "prompt_tokens_mean", "ttft_s", "TTFT", "prompt length (tokens)",
                       floor, "ledger TTFT floor (100 % of peak FLOP/s)", anomalies)


def plot_tpot(summaries, out_dir: Path, anomalies, floor=None) -> Path | None:
    """TPOT vs decode context (sweep, chat-growth); ``floor`` = [(context, seconds)]."""
    return _curve_plot(summaries, out_dir / "tpot_vs_context.png", ("sweep", "chat-growth"),
                       "context_tokens_mean", "tpot_s", "TPOT",
                       "context length (tokens, prompt + output/2)", floor,
                       "ledger TPOT floor", anomalies, unit="ms")


def plot_throughput(summaries: list[dict], out_dir: Path) -> Path | None:
    """Output tokens/s vs concurrency, one line per sweep prompt length."""
    by_len: dict[int, list[tuple[int, float]]] = {}
    for s in summaries:
        if s["workload"] == "sweep" and s["output_throughput_tok_s"] is not None:
            by_len.setdefault(s["prompt_len"], []).append(
                (s["concurrency"], s["output_throughput_tok_s"]))
    if not by_len:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for n, points in sorted(by_len.items()):
        ax.plot(*zip(*sorted(points)), "o-", label=f"prompt {n}")
    ax.set_xticks(sorted({c for points in by_len.values() for c, _ in points}))  # whole numbers
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output throughput (tokens/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Output throughput vs concurrency")
    return _save(fig, out_dir / "throughput_vs_concurrency.png")


def plot_shared_prefix(summaries: list[dict], out_dir: Path) -> Path | None:
    """Grouped bars: median TTFT of the cold request vs the warm ones, per prefix length."""
    rows = [s for s in summaries if s["workload"] == "shared-prefix" and s.get("ttft_by_phase")]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = [f"{s['prompt_len']}\nc={s['concurrency']}" for s in rows]
    for k, phase in enumerate(("cold", "warm")):
        ys = [(s["ttft_by_phase"].get(phase) or {}).get("p50") or 0 for s in rows]
        ax.bar([i + 0.4 * k for i in range(len(rows))], ys, width=0.4, label=phase)
    ax.set_xticks([i + 0.2 for i in range(len(rows))], names)
    ax.set_xlim(-0.6, len(rows))
    ax.set_xlabel("shared prefix (tokens)")
    ax.set_ylabel("median TTFT (s)")
    ax.legend()
    ax.set_title("Shared prefix: first (cold) vs later (warm) requests")
    return _save(fig, out_dir / "shared_prefix_ttft.png")
