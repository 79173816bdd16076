"""The bench report's plots: axes a reader can trust."""

from __future__ import annotations

from kvledger.bench import plots


def test_throughput_plot_ticks_are_the_concurrencies_run(monkeypatch, tmp_path):
    """Concurrency 1 and 2 only: matplotlib's default locator would tick 1.0, 1.2, ... 2.0."""
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    summaries = [{"workload": "sweep", "prompt_len": 64, "concurrency": c,
                  "output_throughput_tok_s": 10.0 * c} for c in (1, 2)]
    plots.plot_throughput(summaries, tmp_path)
    ticks = list(figures[0].axes[0].get_xticks())
    plots.plt.close(figures[0])
    assert ticks == [1, 2]
