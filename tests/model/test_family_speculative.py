"""Speculative decoding on families with sliding-window layers (two layer groups) and MoE:
fp32 greedy tokens with every proposal verified equal transformers' greedy tokens, and each
sequence holds the ledger's window-aware blocks between steps (a rejected proposal's blocks
are given back in every group)."""

from __future__ import annotations

import pytest
from family_kit import W, make_tiny
from oracle_kit import fp32_engine, greedy_case, run_together
from test_family_engine import _holds_the_ledgers_blocks

from kvledger.engine.sample.sampling_params import SamplingParams

STEPS = 40
LENGTHS = (W - 1, W + 1, 2 * W + 3)


@pytest.mark.parametrize("name", ["gemma2", "qwen3_moe"])
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_with_proposals_matches_transformers(name, method, tmp_path_factory):
    folder, spec, weights, prompts, want = greedy_case(make_tiny, name, tmp_path_factory,
                                                       LENGTHS, STEPS)
    engine = fp32_engine(folder, spec, weights,
                         speculative_config={"method": method, "gate": False})
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    assert run_together(engine, prompts, params, check=_holds_the_ledgers_blocks) == want
    assert engine.stats()["spec_proposed_tokens"] > 0
    s = engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
