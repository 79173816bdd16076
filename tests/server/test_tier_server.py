"""The KV tiers through the server (tiny model): /metrics has every tier's series, the chat
usage splits cached tokens by tier, and the dashboard snapshot shows the tiers beside the pool."""

from __future__ import annotations

import torch

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.model.weights.loader import load_weights

PROMPT = list(range(3, 103))  # 100 tokens: 6 full blocks hit at most


def test_metrics_usage_and_dashboard_show_the_tiers(tiny_llama, app_client, tmp_path):
    folder, _ = tiny_llama
    spec, weights = load_weights(folder, torch.float32)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="fp32", num_blocks=8,
                                    kv_ram_gib=0.01, kv_disk_dir=str(tmp_path)), spec=spec,
                       weights=weights)
    client = app_client(engine)
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    client.post("/v1/completions", json=body)
    client.post("/v1/completions", json=body | {"prompt": list(range(200, 300))})  # evicts
    engine.tiers.chain.flush()
    usage = client.post("/v1/completions", json=body).json()["usage"]
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] == 96
    assert sum(details["cached_tokens_by_tier"].values()) == 96
    assert details["cached_tokens_by_tier"]["ram"] > 0
    text = client.get("/metrics").text
    for name in ("kv_tier_hits", "kv_tier_misses", "kv_tier_bytes_read", "kv_tier_bytes_written",
                 "kv_tier_load_seconds", "kv_tier_corrupt_files", "kv_tier_dropped_writes"):
        assert f"kvledger:{name}" in text, name
    ram_hits = [line for line in text.splitlines()
                if line.startswith("kvledger:kv_tier_hits_total") and 'tier="ram"' in line]
    assert ram_hits and float(ram_hits[0].split()[-1]) == details["cached_tokens_by_tier"]["ram"] / 16
    snap = client.get("/dashboard/api/stats").json()
    assert set(snap["tiers"]) == {"ram", "disk"}
    assert snap["tiers"]["disk"]["blocks"] > 0
    engine.close()
