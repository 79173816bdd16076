"""Intact tokens: a sequence's first N tokens (its attention sinks) kept at full precision in a
quantized pool (IntactKV, arXiv:2403.01241).

Oracles (the store's reads of intact tokens and later key groups: ``test_kv_window.py``): fp32 KV
for an engine whose intact tokens cover whole sequences (nothing is ever quantized, so the
greedy tokens are fp32's); self-consistency (cold vs warm prefix cache after the sequences
finished, batch vs alone, a pinned pool with eviction and preemption vs an unbounded one,
the attention backends against each other); the bytes of SmolLM2-135M's K/V per token counted
by hand.
"""

from __future__ import annotations

import pytest
import torch
from test_quantized_engine import _alone, _prompts, _run, tiny_engine_factory  # noqa: F401

from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv_format import KVFormatSpec

INT2 = {"kv_cache_dtype": "int2", "kv_key_group_tokens": 32, "kv_residual_tokens": 48,
        "kv_intact_tokens": 32}


@pytest.mark.parametrize("name, options, tokens, want", [
    # int2 G 32 R 128 N 32, block 16: 2 intact blocks; 200 tokens -> 13 blocks, 6 final
    ("int2", {"key_group_tokens": 32, "residual_tokens": 128, "intact_tokens": 32}, 200,
     (2, 8 + 4, 6, 13 - 6 + 2)),
    # N rounds up to whole key groups: 20 tokens -> 2 one-block groups (int4), 1 64-token
    # group of 4 blocks (int2, G 64)
    ("int4", {"intact_tokens": 20, "residual_tokens": 16}, 40, (2, 1 + 4, 2, 3 - 2 + 2)),
    ("int2", {"intact_tokens": 20, "key_group_tokens": 64, "residual_tokens": 64}, 40,
     (4, 4 + 8, 0, 3)),
    # G = R = 64, no intact tokens: three groups sealed, 8 tokens in the window
    ("int2", {"key_group_tokens": 64, "residual_tokens": 64, "intact_tokens": 0}, 200,
     (0, 4, 12, 1)),
    # int2's defaults (G 32, R 128, N 32): 2 intact blocks, reserve 8 + 2 x 2; 200 tokens ->
    # 3 groups sealed (104 tokens left in the window), 13 - 6 + 2 at full precision
    ("int2", {}, 200, (2, 8 + 4, 6, 13 - 6 + 2)),
])
def test_intact_blocks_rounding_reserve_and_full_precision_blocks(name, options, tokens, want):
    fmt = KVFormatSpec(name, **options)
    got = (fmt.intact_blocks(16), fmt.reserved_blocks(16), fmt.sealed_blocks(tokens, 16),
           fmt.full_precision_blocks(tokens, 16))
    assert got == want


@pytest.mark.parametrize("options, message", [
    ({"name": "bf16", "intact_tokens": 32}, "--kv-intact-tokens applies to quantized KV"),
    ({"name": "int4", "intact_tokens": -16}, "--kv-intact-tokens must be >= 0"),
])
def test_bad_intact_tokens_are_refused(options, message):
    with pytest.raises(InvalidParameterError, match=message):
        KVFormatSpec(**options)


def test_full_precision_what_if_rows_drop_intact_tokens():
    assert KVFormatSpec("int4", intact_tokens=32).as_format("bf16").intact_tokens == 0
    assert KVFormatSpec("int4", intact_tokens=32).as_format("int2").intact_tokens == 32


def test_ledger_reserves_twice_the_intact_tokens_in_the_compute_dtype():
    """SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64 x K and V x 2 bytes (bf16) =
    23,040 bytes per token; 32 intact tokens held twice add 64 tokens' worth per sequence."""
    from kvledger.ledger.kv import residual_bytes
    from kvledger.model.catalogue import load_model_spec

    spec = load_model_spec("HuggingFaceTB/SmolLM2-135M")
    options = {"key_group_tokens": 32, "residual_tokens": 128}
    without = residual_bytes(spec, KVFormatSpec("int2", intact_tokens=0, **options), 1, 16,
                             "bf16")
    with_intact = residual_bytes(spec, KVFormatSpec("int2", intact_tokens=32, **options), 1, 16,
                                 "bf16")
    assert without == 128 * 23_040
    assert with_intact - without == 2 * 32 * 23_040


def test_intact_tokens_over_whole_sequences_equal_fp32_kv(tiny_engine_factory):  # noqa: F811
    """Sequences of at most 64 tokens with 64 intact tokens are never quantized, whatever the
    window: int2 then gives fp32's tokens on both paged backends, batched and alone; without
    the intact tokens it does not."""
    prompts = _prompts(3, length=40)
    full = _run(tiny_engine_factory(num_blocks=64), prompts)
    options = {"kv_cache_dtype": "int2", "kv_key_group_tokens": 16, "kv_residual_tokens": 16}
    assert _run(tiny_engine_factory(num_blocks=64, **options), prompts) != full
    for backend in ("paged-torch", "paged-native"):
        engine = tiny_engine_factory(num_blocks=64, attention=backend, kv_intact_tokens=64,
                                     **options)
        assert _run(engine, prompts) == full, backend
        assert _alone(engine, prompts) == full, backend


def test_cached_intact_blocks_keep_their_buffers_after_the_sequence_ends(
        tiny_engine_factory):  # noqa: F811
    """Prompts sharing 100 tokens, each run alone: later ones hit the intact blocks and the
    key groups after them; then every prompt again, once all have finished, from the prefix
    cache. Cold (no prefix cache), warm and alone agree on every backend when each request is
    fed in the same steps, a block per step (a prefill step reads its own tokens as computed,
    issue 58), a batch of one-step prefills gives each prompt's tokens alone, and the cache
    holds the intact blocks' buffers between requests."""
    prompts = _prompts(3, length=140, shared=100)
    ref = _alone(tiny_engine_factory(num_blocks=64, attention="reference",
                                     enable_prefix_caching=False, max_num_batched_tokens=16,
                                     **INT2), prompts)
    for backend in ("paged-torch", "paged-native"):
        engine = tiny_engine_factory(num_blocks=64, attention=backend, max_num_batched_tokens=16,
                                     **INT2)
        assert _alone(engine, prompts) == ref, backend
        # 96 shared tokens are final in each later prompt: 32 intact + two key groups
        assert engine.stats()["prefix_cache_hit_tokens"] == 2 * 96, backend
        held = int((engine.store.residual_of >= 0).sum())
        assert 0 < held <= engine.config.max_num_seqs * 2  # cached intact blocks only
        assert _alone(engine, prompts, "w") == ref, backend
        # then each prompt's own final blocks: 140, 143, 146 tokens with R 48 keep
        # 3, 3, 4 key groups of 32 final
        assert engine.stats()["prefix_cache_hit_tokens"] == 2 * 96 + 96 + 96 + 128, backend
        uncached = tiny_engine_factory(num_blocks=64, attention=backend,
                                       enable_prefix_caching=False, **INT2)
        assert _run(uncached, prompts) == _alone(uncached, prompts), backend


def test_intact_blocks_under_eviction_reuse_and_the_cache_cap(tiny_engine_factory):  # noqa: F811
    """20 prompts (shared prefixes: hits, evictions, reuse) through 16 blocks, 3 sequences at
    a time, give the tokens of an unbounded pool without a prefix cache; the store never runs
    out of buffers (it asserts so), and at the end the buffers still held are those of
    cached intact blocks, at most max_num_seqs sequences' worth. A token per step: a
    prefill step reads its own tokens as computed (issue 58), so a hit or a recomputed prompt
    reads what the cold run read only when both are fed in the same steps (issue 58)."""
    prompts = _prompts(10, length=70, shared=40) + _prompts(10, length=60, seed=9)
    options = {"kv_cache_dtype": "int2", "kv_key_group_tokens": 32, "kv_residual_tokens": 32,
               "kv_intact_tokens": 32, "max_num_batched_tokens": 1}
    cold = _run(tiny_engine_factory(num_blocks=400, enable_prefix_caching=False, **options),
                prompts)
    pinned = tiny_engine_factory(num_blocks=16, max_num_seqs=3, **options)
    assert _run(pinned, prompts) == cold
    stats = pinned.stats()
    # 16 blocks for 20 prompts of 4-5 blocks: cached blocks are evicted and reused; a token
    # per step admits one request at a time, so nothing is preempted (a preempted request's
    # recomputed prefill reads its tokens as computed, the cold run read them from the pool)
    assert stats["prefix_cache_hit_tokens"] > 0
    pool, store = pinned.scheduler.kv.pool, pinned.store
    held = torch.nonzero(store.residual_of >= 0).flatten().tolist()
    assert len(held) <= 3 * 2
    assert all(pool.is_free(b) and pool.blocks[b].block_hash is not None for b in held)
    pool.evict_free_cached()  # a reset of the prefix cache gives every buffer back
    assert int((store.residual_of >= 0).sum()) == 0


def test_intact_tokens_are_refused_on_sliding_models():
    import dataclasses

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.kv.layout import resolve_layout
    from kvledger.model.catalogue import load_model_spec

    gemma = load_model_spec("google/gemma-3-1b-it")
    config = EngineConfig(kv_cache_dtype="int4", kv_intact_tokens=16)
    with pytest.raises(InvalidParameterError, match="this model has sliding layers"):
        resolve_layout(config, gemma, torch.bfloat16)
    assert resolve_layout(dataclasses.replace(config, kv_intact_tokens=0), gemma,
                          torch.bfloat16).intact_blocks == 0
