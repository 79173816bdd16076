"""Prometheus text parsing and the per-level watcher against a scripted /metrics."""

from __future__ import annotations

import asyncio

import httpx
from fake_sse import FakeServer

from kvledger.bench.metrics import GAUGES, MetricsWatcher, family, parse_exposition
from kvledger.bench.target import Target

VLLM_TEXT = """\
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 12.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.75
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 4.0
weird_line_without_value
"""


def test_parse_keeps_label_sets_and_skips_comments():
    samples = parse_exposition(VLLM_TEXT)
    assert samples["vllm:num_preemptions_total"] == [12.0]
    assert samples["vllm:num_requests_waiting"] == [3.0, 1.0]
    assert family(samples, GAUGES["waiting"]) == 4.0  # counts add up over engines
    assert "weird_line_without_value" not in samples


def test_families_match_any_namespace():
    samples = parse_exposition(VLLM_TEXT.replace("vllm:", "kvledger:"))
    assert family(samples, GAUGES["kv_usage"]) == 0.75
    assert family(samples, GAUGES["running"]) is None
    assert family({"sglang:token_usage": [0.5]}, GAUGES["kv_usage"]) == 0.5


def test_kv_usage_of_two_label_sets_never_exceeds_one():
    # two engines at 60 % each: the peak is 0.6, not 1.2 (before: the family was summed)
    text = ("vllm:kv_cache_usage_perc{engine=\"0\"} 0.6\n"
            "vllm:kv_cache_usage_perc{engine=\"1\"} 0.6\n")

    async def go(url):
        async with httpx.AsyncClient(timeout=5) as client:
            watcher = MetricsWatcher(client, Target.from_url(url), interval=0.01)
            await watcher.start()
            return await watcher.stop()

    with FakeServer(metrics_text=text) as server:
        assert asyncio.run(go(server.url)).kv_usage_peak == 0.6


def test_watcher_reports_availability_and_peaks():
    text = ("kvledger:num_preemptions_total 2\nkvledger:kv_cache_usage_perc 0.5\n"
            "kvledger:num_requests_waiting 0\n")

    async def go(url):
        target = Target.from_url(url)
        async with httpx.AsyncClient(timeout=5) as client:
            watcher = MetricsWatcher(client, target, interval=0.01)
            await watcher.start()
            await asyncio.sleep(0.05)
            return await watcher.stop()

    with FakeServer(metrics_text=text) as server:
        m = asyncio.run(go(server.url))
    assert m.available and m.scrapes >= 2
    assert m.preemptions == 0  # the counter did not move during the level
    assert m.kv_usage_peak == 0.5 and m.waiting_peak == 0
    with FakeServer() as server:
        assert not asyncio.run(go(server.url)).available
