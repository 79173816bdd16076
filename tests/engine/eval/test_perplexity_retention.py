"""``kvledger eval perplexity --kv-policy``: quality under a KV budget is one command.

Oracle: transformers on the same tiny weights with the mask-only reference (every key kept,
dropped keys masked per query, same positions), scored by the same protocol (second half);
for scope ``prompt`` the first half is the prompt, its dropped keys hidden from the second.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from retention_reference import mask_only_logprobs, prompt_mask_logprobs

from kvledger.eval.perplexity import RETENTION_STRIDE, perplexity
from kvledger.ledger.retention import RetentionSpec


def _ids(n: int, seed: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def test_window_perplexity_equals_the_mask_only_reference(tiny_llama, tiny_engine_factory):
    _, hf = tiny_llama
    ids = _ids(128)
    engine = tiny_engine_factory(num_blocks=16, block_size=4, kv_policy="sinks", kv_window=6,
                                 kv_sinks=2, kv_positions="original")
    result = perplexity(engine, ids, 128)
    assert result.stride == RETENTION_STRIDE and "sinks" in result.kv_policy
    ref = mask_only_logprobs(hf, ids, RetentionSpec("sinks", window=6, sinks=2))
    nll = -ref[64:127].gather(1, torch.tensor(ids[65:128])[:, None]).mean()
    assert result.ppl == pytest.approx(math.exp(float(nll)), rel=1e-4)
    full = perplexity(tiny_engine_factory(num_blocks=40, block_size=4), ids, 128)
    assert abs(result.ppl - full.ppl) > 1e-3 * full.ppl  # the policy did change the numbers
    assert engine.stats()["kv_blocks_free"] == 16


def test_a_window_covering_the_chunk_gives_full_perplexity(tiny_engine_factory):
    ids = _ids(300)
    full = perplexity(tiny_engine_factory(num_blocks=40), ids, 96)
    wide = perplexity(tiny_engine_factory(num_blocks=40, kv_policy="window", kv_window=200),
                      ids, 96)
    assert wide.ppl == pytest.approx(full.ppl, rel=1e-5)


def test_h2o_kl_divergence_is_against_full_retention(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=40, kv_policy="h2o", kv_budget=24, kv_window=8)
    base = tiny_engine_factory(num_blocks=40)
    r = perplexity(engine, _ids(200), 96, base=base)
    assert r.kld_mean > 0 and r.ppl_base == pytest.approx(
        perplexity(tiny_engine_factory(num_blocks=40), _ids(200), 96).ppl, rel=1e-5)


def test_prompt_scope_compresses_the_first_half_then_scores_the_second(tiny_llama,
                                                                      tiny_engine_factory):
    """``--kv-scope prompt``: the chunk's first half is the prompt, compressed once to its
    first 2 + last 6 tokens, and the second half is scored keeping every token of its own
    (kvpress's shape): equal to the mask reference (1e-4), unlike full."""
    _, hf = tiny_llama
    ids = _ids(128)
    engine = tiny_engine_factory(num_blocks=40, block_size=4, kv_policy="sinks", kv_window=6,
                                 kv_sinks=2, kv_scope="prompt")
    result = perplexity(engine, ids, 128)
    kept = torch.zeros(64, dtype=torch.bool)
    kept[:2] = kept[58:] = True
    ref = prompt_mask_logprobs(hf, ids, 64, kept)
    nll = -ref[64:127].gather(1, torch.tensor(ids[65:128])[:, None]).mean()
    assert result.ppl == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert "prompt only" in result.kv_policy
    full = perplexity(tiny_engine_factory(num_blocks=40, block_size=4), ids, 128)
    assert abs(result.ppl - full.ppl) > 1e-3 * full.ppl
    assert engine.stats()["kv_blocks_free"] == 40
