"""Ledger overlay: floors computed by hand from the bundled model's architecture."""

from __future__ import annotations

import pytest

from kvledger.bench.overlay import apply_overlay
from kvledger.bench.records import BenchResult

# SmolLM2-135M: tied embeddings 49152 x 576; per layer q/o 576x576, k/v 576x192, MLP
# 3 x 576 x 1536, two norms of 576; 30 layers; final norm 576.
PARAMS = 49152 * 576 + 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576
KV_FP32_PER_TOKEN = 2 * 3 * 64 * 4 * 30  # K and V, 3 KV heads, head_dim 64, fp32, 30 layers
H100_BW, H100_FLOPS = 3350e9, 989e12  # H100 SXM datasheet (dense bf16)


def level(prompt, c, ttft, tpot):
    return {"level": f"sweep L={prompt} c={c}", "workload": "sweep", "concurrency": c,
            "prompt_tokens_mean": prompt, "context_tokens_mean": prompt + 16,
            "ttft_s": {"p50": ttft}, "tpot_s": {"p50": tpot}}


def test_overlay_floors_by_hand():
    assert PARAMS == 134_515_008  # the model card's 135M
    result = BenchResult(meta={}, records=[],
                         summaries=[level(1000, 1, 0.5, 0.1), level(1000, 4, 2.0, 0.2)])
    apply_overlay(result, "default", "H100-SXM", "fp32")
    rows = {(r["level"], r["metric"]): r for r in result.overlay["rows"]}
    attention = 30 * 2 * 9 * (2 * 64) * (1000 * 1001 // 2)
    ttft_floor = (2 * PARAMS * 1000 + attention) / H100_FLOPS
    assert rows["sweep L=1000 c=1", "TTFT"]["floor"] == pytest.approx(ttft_floor, rel=1e-9)
    assert rows["sweep L=1000 c=1", "TTFT"]["ratio"] == pytest.approx(0.5 / ttft_floor)
    tpot_1 = (4 * PARAMS + 1016 * KV_FP32_PER_TOKEN) / H100_BW
    tpot_4 = (4 * PARAMS + 4 * 1016 * KV_FP32_PER_TOKEN) / H100_BW  # 4 sequences' KV read
    assert rows["sweep L=1000 c=1", "TPOT"]["floor"] == pytest.approx(tpot_1, rel=1e-9)
    assert rows["sweep L=1000 c=4", "TPOT"]["floor"] == pytest.approx(tpot_4, rel=1e-9)
    assert result.overlay["tpot_curve"] == [(1016, pytest.approx(tpot_1))]  # c=1 only
    # the TTFT floor is one request's at every concurrency, and the row says so
    assert rows["sweep L=1000 c=4", "TTFT"]["floor_basis"] == "1 request"
    assert rows["sweep L=1000 c=4", "TPOT"]["floor_basis"] == "batch of 4"
    assert "ONE request" in result.overlay["notes"][0]
