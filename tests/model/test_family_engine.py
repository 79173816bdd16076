"""Every family through the engine (issue 34, item 8): greedy tokens equal transformers' for
prompts of 1, W - 1, W, W + 1 and 3W + 5 tokens (W = 16, the tiny models' window), alone,
batched, on prefix-cache hits, under preemption and with chunked prefill, and the KV blocks a
sequence holds equal the ledger's window-aware figure at every length between steps (a
sliding layer holds the blocks of its last W - 1 positions, issue 34 item 6).

The oracle is transformers' greedy choice recomputing the whole sequence each step
(``family_kit.hf_greedy``). ``phi3-long`` is left out: below its 64 original positions
transformers takes LongRoPE's short factors where the engine, whose max length is past them,
took the long ones for good (``kvledger.model.layers.rotary``); its logits are checked past 64
positions in test_family_oracle.py.
"""

from __future__ import annotations

import pytest
from family_kit import W, make_tiny
from oracle_kit import fp32_engine, greedy_case, run_together

from kvledger.engine.engine import LLMEngine
from kvledger.engine.request import NULL_BLOCK
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.ledger.kv import kv_bytes_per_sequence
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.kv_groups import kv_groups, peak_blocks

FAMILIES = ["gemma2", "gemma3", "phi3", "qwen3", "mixtral", "qwen3_moe", "gpt_oss"]
LENGTHS = (1, W - 1, W, W + 1, 3 * W + 5)
STEPS = 16
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
FP32 = KVFormatSpec("fp32")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, folder, spec, weights, prompts, transformers' greedy tokens per prompt)."""
    return (request.param,
            *greedy_case(make_tiny, request.param, tmp_path_factory, LENGTHS, STEPS))


def _engine(family, **options) -> LLMEngine:
    return fp32_engine(*family[1:4], **options)


def _holds_the_ledgers_blocks(engine, req) -> None:
    """``req`` holds in use the ledger's whole blocks for its computed tokens, sliding
    layers' windows only."""
    in_use = [b for table in req.block_tables for b in table if b != NULL_BLOCK]
    assert not any(engine.scheduler.kv.pool.is_free(b) for b in in_use)
    assert len(in_use) * engine.bytes_per_block == kv_bytes_per_sequence(
        engine.spec, engine.kv_layout.fmt, 1, engine.config.block_size,
        req.num_computed_tokens, window_aware=True, paged=True)


def _run(engine, prompts, first: int = 0) -> list[list[int]]:
    """Greedy tokens of ``prompts`` run together, every running sequence checked between
    steps (:func:`_holds_the_ledgers_blocks`)."""
    return run_together(engine, prompts, GREEDY, first, _holds_the_ledgers_blocks)


@pytest.mark.parametrize("attention", ["reference", "paged-native"])
def test_alone_matches_transformers(family, attention):
    _, _, _, _, prompts, want = family
    for prompt, tokens in zip(prompts, want):
        assert _run(_engine(family, attention=attention), [prompt]) == [tokens], len(prompt)


def test_batched_and_prefix_hits_match_transformers(family):
    _, _, _, _, prompts, want = family
    engine = _engine(family)
    assert _run(engine, prompts) == want
    assert _run(engine, prompts, first=len(prompts)) == want  # every full block now a hit
    # a hit never covers a prompt's last token: whole blocks of the first n - 1
    assert engine.stats()["prefix_cache_hit_tokens"] == sum((n - 1) // 16 * 16 for n in LENGTHS)


def test_preempted_matches_transformers(family):
    """A pool just large enough for the longest request alone (the ledger's peak in pages of
    the layer groups), for every request of the batch."""
    _, _, spec, _, prompts, want = family
    longest = max(map(len, prompts)) + STEPS - 1
    engine = _engine(family, num_blocks=peak_blocks(kv_groups(spec), longest, 16))
    assert _run(engine, prompts) == want
    assert engine.stats()["num_preemptions"] > 0


def test_chunked_prefill_matches_transformers(family):
    """Steps of at most 7 tokens: prompts prefilled in chunks that cross blocks and windows."""
    _, _, _, _, prompts, want = family
    assert _run(_engine(family, max_num_batched_tokens=7), prompts) == want


@pytest.mark.parametrize("kv_format", ["int8", "int4"])
def test_quantized_kv_pages_hold_the_ledgers_bytes_under_preemption_and_chunks(family, kv_format):
    """int8 / int4 pages in every layer group: the pool holds exactly the ledger's bytes, and
    with chunks of 7 and a pool for the longest request alone every request completes, each
    holding the ledger's blocks between steps (tokens are not compared: the format is lossy)."""
    _, _, spec, _, prompts, _ = family
    longest = max(map(len, prompts)) + STEPS - 1
    blocks = peak_blocks(kv_groups(spec), longest, 16)
    engine = _engine(family, kv_cache_dtype=kv_format, num_blocks=blocks,
                     max_num_batched_tokens=7)
    assert engine.store.nbytes == blocks * engine.bytes_per_block + engine.kv_layout.reserved_bytes
    assert all(len(tokens) == STEPS for tokens in _run(engine, prompts))


def test_retention_on_sliding_layers_is_refused(family):
    """The retention paths gather slot lists without a window: refused at start and per
    request (HTTP 400), with the layout named."""
    from kvledger.errors import InvalidParameterError
    from kvledger.ledger.retention import RetentionSpec

    _, _, spec, _, prompts, _ = family
    with pytest.raises(InvalidParameterError, match=rf"{spec.model_type}: \d+ of "
                                                    rf"{spec.num_layers} layers slide"):
        _engine(family, kv_policy="window", kv_window=32)
    params = SamplingParams(max_tokens=2, kv_policy=RetentionSpec("sinks", window=32, sinks=4))
    with pytest.raises(InvalidParameterError, match="sliding-window layers"):
        _engine(family).add_request("r", prompts[0], params)
