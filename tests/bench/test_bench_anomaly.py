"""Anomaly detection: a jump is flagged, a clean or mildly superlinear curve is not."""

from __future__ import annotations

import pytest

from kvledger.bench.anomaly import explain, find_anomalies, flag_points, repeated_median_fit

XS = [1024, 2048, 3072, 4096, 5120, 6144, 7168, 8192]


def test_fit_recovers_a_line_despite_one_outlier():
    ys = [0.05 + 1e-5 * x for x in XS]
    ys[5] *= 3
    slope, intercept = repeated_median_fit(XS, ys)
    assert slope == pytest.approx(1e-5) and intercept == pytest.approx(0.05)


def test_clean_linear_series_is_not_flagged():
    assert flag_points(XS, [0.05 + 1e-5 * x for x in XS]) == []


def test_injected_jump_is_flagged():
    ys = [0.05 + 1e-5 * x for x in XS]
    ys[5] *= 3  # TPOT triples at 6144 tokens
    flagged = flag_points(XS, ys)
    assert [i for i, _ in flagged] == [5]
    assert flagged[0][1] == pytest.approx(0.05 + 1e-5 * 6144)


def test_jump_at_the_last_of_four_points_is_flagged():
    assert [i for i, _ in flag_points([1, 2, 3, 4], [1.0, 2.0, 3.0, 12.0])] == [3]


def test_superlinear_prefill_of_the_cpu_peers_is_not_flagged():
    # transformers fp32 TTFT at 256..4096 tokens on this machine (shared/PEERS.md): the
    # attention term makes it superlinear, which is not a jump
    xs, ys = [256, 512, 1024, 2048, 4096], [0.32, 0.55, 1.23, 3.08, 7.54]
    assert flag_points(xs, ys) == []


def test_noisy_flat_series_is_not_flagged():
    ys = [0.050, 0.052, 0.049, 0.051, 0.050, 0.053, 0.048, 0.050]
    assert flag_points(XS, ys) == []


def test_too_few_points_are_not_checked():
    assert flag_points([1, 2, 3], [1.0, 2.0, 30.0]) == []


def summary(n, tpot, metrics, c=1):
    return {"level": f"sweep L={n} c={c}", "workload": "sweep", "concurrency": c,
            "prompt_tokens_mean": n, "context_tokens_mean": n + 64, "failures": 0,
            "ttft_s": {"p50": 1e-4 * n}, "tpot_s": {"p50": tpot}, "metrics": metrics}


def test_find_anomalies_explains_with_preemptions_and_full_kv():
    calm = {"available": True, "preemptions": 0, "kv_usage_peak": 0.3, "waiting_peak": 0}
    hot = {"available": True, "preemptions": 12, "kv_usage_peak": 1.0, "waiting_peak": 3}
    levels = [summary(n, 0.05 + 1e-6 * n, calm) for n in (1024, 2048, 4096)]
    levels.append(summary(8192, 3 * (0.05 + 1e-6 * 8256), hot))
    levels.append(summary(16384, 0.05 + 1e-6 * 16448, calm))
    anomalies, notes = find_anomalies(levels)
    assert [(a.metric, a.level) for a in anomalies] == [("TPOT", "sweep L=8192 c=1")]
    message = anomalies[0].message()
    assert "3.0x" in message and "12 preemption(s)" in message
    assert "KV cache usage hit 100 %" in message and "3 request(s) waited" in message
    assert "memory pressure" in message
    assert notes == []


def test_explain_without_metrics_says_so():
    assert "no /metrics" in explain({"available": False}, [], 0)


def test_explain_without_memory_pressure_points_at_the_host():
    text = explain({"available": True, "preemptions": 0, "kv_usage_peak": 0.2}, [], 0)
    assert "suspect the host" in text
