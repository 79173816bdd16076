"""The gauges routers and endpoint pickers read (``vllm:num_requests_waiting``,
``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``) are
on without ``--metrics-compat`` and equal the scheduler's own counts, at idle and with the
engine held mid-load (its queues and pool read directly while its thread waits)."""

from __future__ import annotations

import threading
import time

import torch
from prometheus_client.parser import text_string_to_metric_families

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.model.weights.loader import load_weights


class HeldEngine(LLMEngine):
    """An engine whose thread waits at the start of a step while ``hold`` is set, and whose
    ``stats()`` takes half a second once it is idle while ``slow_stats`` is set (so a server
    that answered before it refreshed its gauges is caught reading old ones)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold, self.held, self.steps = threading.Event(), threading.Event(), 0
        self.slow_stats = False

    def stats(self):
        if self.slow_stats and not self.has_unfinished_requests():
            time.sleep(0.5)
        return super().stats()

    def step(self):
        while self.hold.is_set():
            self.held.set()
            time.sleep(0.01)
        out = super().step()
        self.steps += 1
        return out


def gauges(client) -> dict[str, float | dict]:
    out = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name == "vllm:cache_config_info":
                out[s.name] = s.labels
            elif s.name.startswith("vllm:"):
                out[s.name] = s.value
    return out


def counts(engine) -> dict[str, float]:
    """The scheduler's counts, read from its queues and pool (the oracle)."""
    sched = engine.scheduler
    pool = sched.kv.pool
    return {"vllm:num_requests_running": len(sched.running),
            "vllm:num_requests_waiting": len(sched.waiting),
            "vllm:kv_cache_usage_perc": pool.num_in_use / pool.num_blocks}


def test_router_gauges_equal_the_schedulers_counts(tiny_llama, app_client):
    folder, _ = tiny_llama
    spec, weights = load_weights(folder, torch.float32)
    engine = HeldEngine(EngineConfig(model=str(folder), dtype="fp32", max_num_seqs=2,
                                     num_blocks=40), spec=spec, weights=weights)
    client = app_client(engine)
    seen = gauges(client)
    info = seen.pop("vllm:cache_config_info")
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "40"
    assert {k: v for k, v in seen.items() if k != "vllm:gpu_cache_usage_perc"} == counts(engine)

    threads = [threading.Thread(target=client.post, args=("/v1/completions",), kwargs={
        "json": {"prompt": [5 + i] * 30, "max_tokens": 150, "ignore_eos": True}})
        for i in range(5)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(engine.scheduler.requests) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    after = engine.steps
    while engine.steps == after and time.monotonic() < deadline:
        time.sleep(0.005)
    engine.hold.set()
    assert engine.held.wait(30)
    under_load = counts(engine)
    assert under_load["vllm:num_requests_running"] == 2
    assert under_load["vllm:num_requests_waiting"] >= 1
    seen = gauges(client)
    assert {k: seen[k] for k in under_load} == under_load
    assert seen["vllm:gpu_cache_usage_perc"] == under_load["vllm:kv_cache_usage_perc"]
    engine.slow_stats = True
    engine.hold.clear()
    for t in threads:
        t.join()
    seen = gauges(client)
    assert {k: seen[k] for k in under_load} == counts(engine) == {
        "vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0,
        "vllm:kv_cache_usage_perc": 0.0}
