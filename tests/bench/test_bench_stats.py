"""Percentiles and level summaries on hand-computed examples."""

from __future__ import annotations

import pytest

from kvledger.bench.metrics import LevelMetrics
from kvledger.bench.records import Level, RequestRecord
from kvledger.bench.stats import percentile, summarize, summarize_level


def test_percentile_linear_interpolation_by_hand():
    xs = [4.0, 1.0, 3.0, 2.0, 10.0]  # sorted: 1 2 3 4 10
    assert percentile(xs, 50) == 3.0  # h = 4 * 0.5 = 2 -> x[2]
    assert percentile(xs, 90) == pytest.approx(7.6)  # h = 3.6 -> 4 + 0.6 * (10 - 4)
    assert percentile(xs, 99) == pytest.approx(9.76)  # h = 3.96 -> 4 + 0.96 * 6
    assert percentile(xs, 25) == 2.0  # h = 1
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    assert percentile([7.0], 99) == 7.0


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_by_hand():
    s = summarize([0.1, 0.2, 0.3, 0.4])
    assert s["n"] == 4
    assert s["mean"] == pytest.approx(0.25)
    assert s["p50"] == pytest.approx(0.25)  # h = 1.5
    assert s["p90"] == pytest.approx(0.37)  # h = 2.7 -> 0.3 + 0.7 * 0.1
    assert summarize([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def record(i, ok=True, ttft=None, e2e=None, out=None, itl=(), arrival=0.0, send=0.0):
    tpot = (e2e - ttft) / (out - 1) if ok else None
    return RequestRecord(
        level="sweep L=100 c=2", workload="sweep", index=i, uid=str(i), phase="",
        concurrency=2, level_prompt_len=100, target_prompt_tokens=100,
        requested_output_tokens=5, arrival_s=arrival, send_s=send, ok=ok,
        error=None if ok else "boom", ttft_s=ttft, e2e_s=e2e, tpot_s=tpot,
        output_tokens=out, prompt_tokens=100 if ok else None, content_events=len(itl) + ok,
        itl_s=list(itl),
    )


def test_level_summary_excludes_failures_and_pools_itl():
    records = [
        record(0, ttft=0.2, e2e=1.0, out=5, itl=[0.2, 0.2, 0.2, 0.2], send=0.0),
        record(1, ttft=0.4, e2e=1.6, out=5, itl=[0.3, 0.3, 0.6], send=1.0),  # waited 1 s
        record(2, ok=False, send=2.0, arrival=0.0),
    ]
    s = summarize_level(Level("sweep", 100, 2, []), records, wall_s=2.0,
                        metrics=LevelMetrics())
    assert s["requests"] == 3 and s["failures"] == 1
    assert s["ttft_s"]["n"] == 2 and s["ttft_s"]["mean"] == pytest.approx(0.3)
    # TPOT: (1.0 - 0.2) / 4 = 0.2 and (1.6 - 0.4) / 4 = 0.3
    assert s["tpot_s"]["mean"] == pytest.approx(0.25)
    assert s["itl_s"]["n"] == 7 and s["itl_s"]["p50"] == pytest.approx(0.2)
    assert s["slot_wait_s"]["mean"] == pytest.approx(1.0)  # (0 + 1 + 2) / 3
    assert s["output_throughput_tok_s"] == pytest.approx(5.0)  # 10 tokens / 2 s
    assert s["total_throughput_tok_s"] == pytest.approx(105.0)  # (200 + 10) / 2 s
    assert s["context_tokens_mean"] == pytest.approx(102.5)  # 100 + 5 / 2
