"""Load or recompute (``ledger/tier_load.py``) against figures written out by hand from
SmolLM2-135M's config: 30 layers, 9 query heads, 3 KV heads, head_dim 64, hidden 576,
intermediate 1536, vocabulary 49,152 (tied), so

- KV bytes per token in bf16: 2 (K, V) x 30 layers x 3 KV heads x 64 x 2 bytes = 23,040,
  a 16-token block 368,640 bytes;
- parameters: 49,152 x 576 embedding + 30 x (2 x 576^2 + 2 x 576 x 192 attention,
  3 x 576 x 1536 MLP, 2 x 576 norms) + 576 final norm = 134,515,008 (the model card's 135M);
- prefill FLOPs of the token at position i (1-based, seeing i keys): 2 x 134,515,008 plus
  30 layers x 2 x 9 heads x (64 + 64) x i for the score and mix matmuls.
"""

from __future__ import annotations

import pytest

from kvledger.data import config_path
from kvledger.errors import InvalidParameterError
from kvledger.ledger.tier_load import (
    ReadSpeed,
    crossover,
    recompute_seconds,
    save_figures,
    saved_figures,
)
from kvledger.model.families import spec_from_hf_config

BLOCK_BYTES, PARAMS, PAIR_FLOPS = 368_640, 134_515_008, 30 * 2 * 9 * 128
assert 49_152 * 576 + 30 * (2 * 576**2 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576 \
    == PARAMS


@pytest.fixture
def smollm():
    return spec_from_hf_config(config_path("HuggingFaceTB__SmolLM2-135M"))


def hand_recompute_s(start: int, end: int, flops_per_s: float) -> float:
    return sum(2 * PARAMS + PAIR_FLOPS * i for i in range(start + 1, end + 1)) / flops_per_s


def hand_crossover(read_bytes_per_s: float, file_s: float, flops_per_s: float) -> int | None:
    """The first whole-block prefix (16 tokens a block) whose load beats its prefill."""
    for blocks in range(1, 8192 // 16 + 1):
        load = blocks * (file_s + BLOCK_BYTES / read_bytes_per_s)
        if load < hand_recompute_s(0, 16 * blocks, flops_per_s):
            return 16 * blocks
    return None


def test_recompute_counts_the_tokens_and_the_pairs_they_add(smollm):
    assert recompute_seconds(smollm, PARAMS, 100, 164, 1e12) == pytest.approx(
        hand_recompute_s(100, 164, 1e12))
    assert recompute_seconds(smollm, PARAMS, 64, 64, 1e12) == 0


@pytest.mark.parametrize("gbps, file_s, tflops", [
    (2.0, 0.0, 40.0),        # an H100-class prefill against a 2 GB/s disk: ~5.5K tokens
    (0.5, 100e-6, 40.0),     # a slow disk with a per-file cost: past the 8K context
    (3.0, 20e-6, 40.0),      # a per-file cost: ~2.5K tokens
    (1.0, 0.0, 0.05),        # a CPU-class prefill: loading wins from the first block
])
def test_crossover_equals_the_hand_computed_one(smollm, gbps, file_s, tflops):
    c = crossover(smollm, PARAMS, BLOCK_BYTES, 16, ReadSpeed(gbps * 1e9, file_s),
                  tflops * 1e12, smollm.max_position_embeddings)
    expected = hand_crossover(gbps * 1e9, file_s, tflops * 1e12)
    assert c.tokens == expected
    assert c.bytes == (None if expected is None else expected // 16 * BLOCK_BYTES)


def test_the_first_crossover_is_about_where_per_token_costs_meet(smollm):
    """Closed form of the first case: 23,040 / 2e9 = (2 x PARAMS + PAIR_FLOPS x (n + 1) / 2) /
    40e12 -> n = 5,549, so 5,552 tokens in whole blocks."""
    c = crossover(smollm, PARAMS, BLOCK_BYTES, 16, ReadSpeed(2e9), 40e12, 8192)
    assert (c.tokens, c.bytes) == (5_552, 347 * BLOCK_BYTES)


def test_bad_speeds_are_refused(smollm):
    with pytest.raises(InvalidParameterError):
        ReadSpeed(0.0)
    with pytest.raises(InvalidParameterError):
        crossover(smollm, PARAMS, BLOCK_BYTES, 16, ReadSpeed(1e9), 0.0, 8192)


def test_saved_figures_read_back_and_malformed_ones_are_unknown(tmp_path):
    save_figures(tmp_path / "a", {"cold_bytes_per_s": 5e8, "cold_file_s": 1e-4,
                                  "warm_bytes_per_s": "fast", "prefill_flops_per_s": -1},
                 tmp_path / "config")
    figures = saved_figures(tmp_path / "a", tmp_path / "config")
    assert figures.cold == ReadSpeed(5e8, 1e-4)
    assert figures.warm is None and figures.prefill_flops_per_s is None
    (tmp_path / "config" / "kv_tier_read.json").write_text("{not json")
    assert saved_figures(tmp_path / "a", tmp_path / "config").cold is None
