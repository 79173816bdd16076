"""Streaming past the model's context (StreamingLLM): window/sinks requests generate beyond the
tiny model's 512 positions in a bounded KV. Oracles: transformers on the same weights with the
mask-only reference (every key kept, dropped keys masked, original positions: transformers
computes RoPE for any position), and the policy's bound from ``ledger/retention.py``, which
admission uses (``RequestBudget.kv_blocks_of``). Tiny random Llama, fp32."""

from __future__ import annotations

import math

import pytest
import torch
from retention_reference import mask_only_logprobs

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import ContextLengthError, KVBudgetError
from kvledger.ledger.retention import RetentionSpec

PROMPT = [(13 * i + 7) % 300 + 3 for i in range(200)]  # prefilled in chunks of 64
NEW = 320  # 200 + 320 = 520 tokens > the tiny model's 512 positions
SPECS = {"sinks": {"policy": "sinks", "window": 24, "sinks": 4, "positions": "original"},
         "window": {"policy": "window", "window": 28}}


def params(kv_policy=None, logprobs=None):
    return SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, kv_policy=kv_policy,
                          logprobs=logprobs)


@pytest.mark.parametrize("name", ["sinks", pytest.param("window", marks=pytest.mark.slow)])
def test_streaming_past_the_context_equals_the_mask_only_reference(tiny_llama,
                                                                   tiny_engine_factory, name):
    """520 tokens through a 512-position model in a pool of exactly the policy's bound: the
    request is admitted (full retention is refused), never holds more blocks than the bound,
    the pool's bytes equal the ledger's at every step (allocated = blocks x bytes per block,
    predicted = tokens held x bytes per token), every logprob is finite and equals the
    mask-only reference's at 1e-4, token for token past position 512."""
    _, hf = tiny_llama
    spec = RetentionSpec.from_dict(SPECS[name])
    total = len(PROMPT) + NEW
    bound = spec.max_kv_blocks(len(PROMPT), total, 4)
    assert bound < math.ceil(512 / 4)  # the bound is below even the context's blocks
    engine = tiny_engine_factory(block_size=4, num_blocks=bound)
    assert engine.scheduler.budget.kv_blocks_of(total, spec, len(PROMPT)) == bound
    with pytest.raises(ContextLengthError, match="maximum context length is 512"):
        engine.add_request("full", PROMPT, params())
    engine.add_request("r", PROMPT, params(SPECS[name], logprobs=0))
    one_token_blocks = _count_one_token_block_reads(engine)
    peaks, most_held, out = [], 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        engine.scheduler.check_invariants()
        s = engine.stats()
        in_use = s["kv_blocks_total"] - s["kv_blocks_free"]
        assert s["kv_bytes_allocated"] == in_use * engine.bytes_per_block
        for req in engine.scheduler.running:
            peaks.append(len(req.block_table))
            assert in_use == len(req.block_table) <= bound
            held = req.retention.num_held
            assert held <= spec.capacity - 1
            most_held = max(most_held, held)
            assert s["kv_bytes_predicted"] == held * engine.bytes_per_token
    assert len(out.token_ids) == NEW and out.finish_reason == "length"
    assert engine.scheduler.kv.pool.num_free == bound  # all free at idle
    assert max(peaks) <= bound and most_held == spec.capacity - 1  # it did evict
    if engine.model.attention.name == "paged-native":  # decodes read the slot lists in place
        assert one_token_blocks["calls"] >= (NEW - 1) * engine.spec.num_layers
    logprobs = torch.tensor([lp.logprob for lp in out.logprobs])
    assert torch.isfinite(logprobs).all()
    ref = mask_only_logprobs(hf, (PROMPT + out.token_ids)[:-1], spec)
    for i, lp in enumerate(out.logprobs):
        row = ref[len(PROMPT) - 1 + i]
        # greedy: the engine's token is the reference's best (up to the logprob tolerance)
        assert float(row[lp.token_id]) >= float(row.max()) - 1e-4, (i, lp.token_id)
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4, (i, lp.logprob)


def test_one_block_less_than_the_bound_is_refused_at_admission(tiny_engine_factory):
    """The admission figure is the bound itself: a pool one block short refuses the streaming
    request before it runs, naming the blocks it needs."""
    spec = RetentionSpec.from_dict(SPECS["sinks"])
    bound = spec.max_kv_blocks(len(PROMPT), len(PROMPT) + NEW, 4)
    engine = tiny_engine_factory(block_size=4, num_blocks=bound - 1)
    with pytest.raises(KVBudgetError, match=f"= {bound} blocks"):
        engine.add_request("r", PROMPT, params(SPECS["sinks"]))
    assert not engine.has_unfinished_requests()


def _count_one_token_block_reads(engine) -> dict:
    """Count the native kernel's calls over the pool viewed as blocks of one token (the
    slot-list decode of an evicting policy); other backends have no kernel to count."""
    calls = {"calls": 0}
    backend = engine.model.attention
    kernel = getattr(backend, "kernel", None)
    if kernel is None:
        return calls

    def counting(q, keys, values, paged, *layer, **options):
        calls["calls"] += keys.shape[1] == 1
        return kernel(q, keys, values, paged, *layer, **options)

    backend.kernel = counting
    counting.accepts = kernel.accepts
    return calls
