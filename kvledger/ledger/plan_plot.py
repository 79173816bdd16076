"""``kvledger plan --plot`` and the dashboard's planner: KV bytes per request and concurrency
against context, per KV format.

Draws from the same :func:`kvledger.ledger.planner.plan` as the tables, on a doubling grid of
contexts from 512 tokens to the largest requested context. matplotlib (Agg backend, no display)
is imported here only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvledger.ledger.hardware import Device, GiB
from kvledger.ledger.planner import PlanOptions, plan
from kvledger.spec import ModelSpec


def context_grid(largest: int, start: int = 512) -> tuple[int, ...]:
    """Doubling contexts from ``start`` up to and including ``largest``."""
    grid, n = [], start
    while n < largest:
        grid.append(n)
        n *= 2
    return (*grid, largest)


def write_plot(spec: ModelSpec, device: Device, options: PlanOptions, path: Path) -> None:
    """Write a two-panel PNG: KV GiB per request (log-log) and max concurrency vs context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = context_grid(max(options.contexts))
    p = plan(spec, device, replace(options, contexts=grid, shared_prefix=0))
    fig, (ax_kv, ax_conc) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[tuple, list] = {}  # formats with identical bytes share one line (fp16 = bf16)
    for f in p.formats:
        series.setdefault(f.kv_bytes_per_sequence, [f, []])[1].append(f.kv_format)
    for f, names in series.values():
        label = " = ".join(names)
        ax_kv.plot(grid, [b / GiB for b in f.kv_bytes_per_sequence], marker="o", label=label)
        ax_conc.plot(grid, f.max_concurrency, marker="o", label=label)
    ax_kv.axhline(p.weights_bytes / GiB, color="grey", linestyle="--", label="weights")
    ax_kv.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="KV per request (GiB)")
    ax_conc.set(xscale="log", xlabel="context (tokens)", ylabel="max concurrent requests")
    ax_conc.set_yscale("symlog", linthresh=1)
    ax_conc.set_ylim(bottom=0)
    ax_kv.set_title(f"{spec.name}: KV bytes per request")
    ax_conc.set_title(
        f"on {device.name} ({options.gpu_util:g} util, {options.reserve_gib:g} GiB reserve)"
    )
    for ax in (ax_kv, ax_conc):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
