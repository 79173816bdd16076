"""DeepSeek-V2 through the engine (issue 36, items 2 to 5): greedy tokens equal transformers'
for prompts of 1, 15, 16, 17 and 53 tokens, alone, batched, on prefix-cache hits, under
preemption and with chunked prefill, on the latent pool; the pool and every sequence hold
the ledger's MLA bytes, ``(kv_lora_rank + qk_rope_head_dim) x layers x element bytes`` per
token slot; what the latent does not run is refused at start, naming MLA.
"""

from __future__ import annotations

import pytest
from deepseek_kit import FEATURES, make_tiny
from oracle_kit import fp32_engine, greedy_case, run_together

from kvledger.engine.engine import LLMEngine
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import kv_bytes_per_sequence, kv_bytes_per_token
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.kv_groups import kv_groups, peak_blocks
from kvledger.ledger.retention import RetentionSpec

LENGTHS = (1, 15, 16, 17, 53)
STEPS = 16
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(FEATURES))
def variant(request, tmp_path_factory):
    """(folder, spec, weights, prompts, transformers' greedy tokens per prompt)."""
    return greedy_case(make_tiny, request.param, tmp_path_factory, LENGTHS, STEPS)


def _engine(variant, **options) -> LLMEngine:
    return fp32_engine(*variant[:3], **options)


def _holds_the_ledgers_bytes(engine, req) -> None:
    assert len(req.block_table) * engine.bytes_per_block == kv_bytes_per_sequence(
        engine.spec, engine.kv_layout.fmt, 1, engine.config.block_size,
        req.num_computed_tokens, paged=True)


def _run(engine, prompts, first: int = 0) -> list[list[int]]:
    """Greedy tokens of ``prompts`` run together; between steps every running sequence holds
    the ledger's bytes for its computed tokens."""
    return run_together(engine, prompts, GREEDY, first, _holds_the_ledgers_bytes)


@pytest.mark.parametrize("attention", ["reference", "paged-torch", "paged-native"])
def test_alone_matches_transformers(variant, attention):
    _, _, _, prompts, want = variant
    for prompt, tokens in zip(prompts, want):
        assert _run(_engine(variant, attention=attention), [prompt]) == [tokens], len(prompt)


def test_batched_and_prefix_hits_match_transformers(variant):
    _, _, _, prompts, want = variant
    engine = _engine(variant)
    assert _run(engine, prompts) == want
    assert _run(engine, prompts, first=len(prompts)) == want  # every full block now a hit
    assert engine.stats()["prefix_cache_hit_tokens"] == sum((n - 1) // 16 * 16 for n in LENGTHS)


def test_preempted_matches_transformers(variant):
    _, spec, _, prompts, want = variant
    longest = max(map(len, prompts)) + STEPS - 1
    engine = _engine(variant, num_blocks=peak_blocks(kv_groups(spec), longest, 16))
    assert _run(engine, prompts) == want
    assert engine.stats()["num_preemptions"] > 0


def test_chunked_prefill_matches_transformers(variant):
    _, _, _, prompts, want = variant
    assert _run(_engine(variant, max_num_batched_tokens=7), prompts) == want


@pytest.mark.parametrize("kv_format,element", [("fp32", 4), ("bf16", 2), ("fp16", 2)])
def test_the_pool_holds_the_latent_bytes(variant, kv_format, element):
    """The latent per token slot and layer, nothing per head: the ledger's figure, and the
    store's tensors hold exactly that many bytes per block."""
    _, spec, _, _, _ = variant
    engine = _engine(variant, kv_cache_dtype=kv_format, num_blocks=12)
    latent = spec.latent.kv_lora_rank + spec.latent.qk_rope_head_dim
    per_token = latent * spec.num_layers * element
    assert kv_bytes_per_token(spec, KVFormatSpec(kv_format), 1, 16) == per_token
    assert engine.bytes_per_block == 16 * per_token
    assert engine.store.nbytes == 12 * 16 * per_token
    assert engine.store.key_blocks[0] is engine.store.value_blocks[0]


REFUSED = {
    "int8": ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype int8 is not supported on MLA"),
    "fp8": ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8 is not supported on MLA"),
    "rotation": ({"kv_cache_dtype": "int4", "kv_rotation": "hadamard"},
                 "--kv-rotation hadamard is not supported on MLA"),
    "retention": ({"kv_policy": "window", "kv_window": 32}, "'window' does not run on MLA"),
    "tensor parallel": ({"tensor_parallel_size": 2}, "uses MLA"),
    "RAM tier": ({"kv_ram_gib": 0.5}, "KV tiers .* do not support MLA"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_latent_does_not_run_is_refused_at_start(variant, case):
    options, message = REFUSED[case]
    with pytest.raises(InvalidParameterError, match=message):
        _engine(variant, **options)


def test_an_evicting_policy_per_request_is_refused(variant):
    """Per request too (the server's HTTP 400)."""
    _, _, _, prompts, _ = variant
    params = SamplingParams(max_tokens=2, kv_policy=RetentionSpec("sinks", window=32, sinks=4))
    with pytest.raises(InvalidParameterError, match="does not run on MLA"):
        _engine(variant).add_request("r", prompts[0], params)
