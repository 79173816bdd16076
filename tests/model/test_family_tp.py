"""Tensor parallelism covers Qwen3 and Gemma 3 (issue 34 item 6): TP = 2 over the tiny models
of ``family_kit`` (q/k norms, sandwich norms, sliding and global layers, Gemma's scaled
embedding) gives transformers' greedy tokens, alone and batched past the window."""

from __future__ import annotations

import pytest
import torch
from family_kit import W, hf_greedy, make_tiny

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.model.weights.loader import load_weights

STEPS = 8


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_tp2_greedy_tokens_equal_transformers(family, tmp_path):
    hf_model = make_tiny(family, tmp_path)
    prompts = [[(7 * i + 3) % 300 + 3 for i in range(n)] for n in (W + 1, 3 * W + 5)]
    want = [hf_greedy(hf_model, p, STEPS) for p in prompts]
    spec, weights = load_weights(tmp_path, torch.float32)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="fp32", attention="paged-native",
                                    tensor_parallel_size=2), spec=spec, weights=weights)
    try:
        params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    finally:
        engine.close()
    assert [done["r0"], done["r1"]] == want
