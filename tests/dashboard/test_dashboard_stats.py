"""The dashboard's snapshot of a real engine (a tiny GGUF Llama), its histograms and alerts.

Expected block counts and bytes are worked out by hand from the tiny model's shape: 1 layer,
1 KV head of head_dim 16, fp32, 16-token blocks -> 2 x 16 x 4 x 16 = 2048 bytes per block.
"""

from __future__ import annotations

import pytest

from kvledger.server.dashboard.stats import (
    CACHED,
    FREE,
    SHARED,
    alerts,
    counter_values,
    engine_snapshot,
    latency_histograms,
)

BLOCK = 16
BYTES_PER_BLOCK = 2 * 1 * 16 * 4 * BLOCK
PROMPT = [3, 5, 7, 2, 4, 6, 8, 9] * 5  # 40 tokens: 2 full blocks + 8 tokens


@pytest.fixture
def engine(tmp_path, gguf_kit):
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_weights

    path = gguf_kit.write(tmp_path / "tiny.gguf", gguf_kit.to_gguf(gguf_kit.hf_weights()))
    spec, weights = load_weights(path, torch.float32)
    return LLMEngine(EngineConfig(model=str(path), dtype="fp32", num_blocks=12,
                                  block_size=BLOCK),
                     spec=spec, weights=weights)


def params(n):
    from kvledger.engine.sample.sampling_params import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_to_end(engine):
    while engine.has_unfinished_requests():
        engine.step()


def test_running_request_owns_its_blocks_then_they_turn_cached(engine):
    engine.add_request("a", PROMPT, params(5))
    engine.step()  # the whole prompt is prefilled in one step, one token sampled
    snap = engine_snapshot(engine)
    assert snap["pool"]["bytes_per_block"] == BYTES_PER_BLOCK
    [row] = snap["requests"]
    assert (row["id"], row["state"], row["prompt_tokens"], row["output_tokens"]) == (
        "a", "running", 40, 1)
    assert row["blocks"] == 3  # 40 computed tokens -> ceil(40 / 16)
    assert row["kv_bytes"] == 3 * BYTES_PER_BLOCK
    assert row["quota_bytes"] == 3 * BYTES_PER_BLOCK  # 40 + 5 = 45 tokens -> 3 blocks
    assert snap["blocks"].count(0) == 3
    assert snap["blocks"].count(FREE) == 12 - 3
    assert "text" not in row and "prompt" not in row

    run_to_end(engine)
    snap = engine_snapshot(engine)
    assert snap["requests"] == []
    # 40 + 4 computed tokens (the last sampled token never gets KV): 2 full blocks stay cached
    assert snap["blocks"].count(CACHED) == 2
    assert snap["blocks"].count(FREE) == 10
    assert snap["pool"]["blocks_in_use"] == 0


def test_prefix_hit_blocks_are_shared(engine):
    engine.add_request("warm", PROMPT, params(1))
    run_to_end(engine)
    engine.add_request("b", PROMPT, params(3))
    engine.add_request("c", PROMPT, params(3))
    engine.step()
    snap = engine_snapshot(engine)
    ids = [r["id"] for r in snap["requests"]]
    assert ids == ["b", "c"]
    # both hit the 2 cached full blocks; each adds one block for its last 8 prompt tokens
    assert snap["blocks"].count(SHARED) == 2
    assert snap["blocks"].count(0) == 1 and snap["blocks"].count(1) == 1
    assert [r["cached_tokens"] for r in snap["requests"]] == [32, 32]
    assert snap["stats"]["kv_bytes_allocated"] == 4 * BYTES_PER_BLOCK
    assert alerts(snap, {}, True) == []


def test_waiting_requests_are_listed_after_running(engine):
    engine.add_request("first", PROMPT, params(2))
    engine.step()
    engine.add_request("second", PROMPT[:10], params(2))
    snap = engine_snapshot(engine)
    assert [(r["id"], r["state"], r["blocks"]) for r in snap["requests"]] == [
        ("first", "running", 3), ("second", "waiting", 0)]


def test_latency_histograms_are_per_bucket_counts():
    from kvledger.server.metrics.server_metrics import ServerMetrics

    m = ServerMetrics("m")
    for value in (0.003, 0.004, 0.2, 100.0):
        m.histograms["time_to_first_token_seconds"].observe(value)
    m.histograms["request_time_per_output_token_seconds"].observe(0.012)
    h = latency_histograms(m.registry)
    ttft = h["ttft"]
    assert ttft["count"] == 4 and ttft["sum"] == pytest.approx(100.207)
    counts = dict(zip(ttft["le"], ttft["counts"]))
    assert counts[0.005] == 2 and counts[0.25] == 1 and counts[0.001] == 0
    assert ttft["counts"][-1] == 1  # 100 s is past the last bound (80 s): the overflow bucket
    assert len(ttft["counts"]) == len(ttft["le"]) + 1
    assert sum(h["tpot"]["counts"]) == 1 and h["itl"]["count"] == 0


def test_counter_values():
    from kvledger.server.metrics.server_metrics import ServerMetrics

    m = ServerMetrics("m")
    m.counters["kv_alerts"].inc(2)
    m.count_finished("stop")
    m.count_finished("length")
    values = counter_values(m.registry)
    assert values["kv_alerts"] == 2 and values["request_success"] == 2


def _snap(allocated, predicted, running, usage=0.1):
    requests = [{"state": "running"}] * running
    return {"stats": {"kv_bytes_allocated": allocated, "kv_bytes_predicted": predicted,
                      "kv_usage": usage, "num_waiting": 3},
            "pool": {"bytes_per_block": 100}, "requests": requests}


def test_alerts():
    assert alerts(_snap(250, 200, 1), {}, True) == []  # within one partial block per request
    [mismatch] = alerts(_snap(301, 200, 1), {}, True)
    assert mismatch["level"] == "error" and "ledger mismatch" in mismatch["message"]
    [full] = alerts(_snap(0, 0, 0, usage=0.95), {}, True)
    assert full["level"] == "warning" and "95%" in full["message"] and "3 requests" in full["message"]
    levels = [a["level"] for a in alerts(_snap(0, 0, 0), {"kv_alerts": 2}, False)]
    assert levels == ["error", "info"]
