"""A prefill step attends over its own tokens' K/V as computed, and over earlier tokens as the
quantized pool holds them; decodes read the pool (issue 58).

Oracles: bf16 and fp32 KV (a step's own tokens: one prefill of a whole prompt gives their
logits, to fp32 tolerance, in every quantized format) and transformers on the same weights
(fp32), fed step by step with a cache that holds what the pool holds at that step: the sealed
blocks (before the step's first block, outside the intact ones) as the format's codec encodes
and decodes them (rotated by the store's rotation, a key group's blocks encoded together; the
codecs are tested against their formats in tests/engine/kv/test_codecs.py), every other token
as computed. Each test fails on the code before issue 58, where a prefill step read its own
tokens back from the pool.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvledger.engine.kv.codecs import GroupedKeys
from kvledger.engine.request import Request
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.eval.scoring import step_logprobs

BACKENDS = ["reference", "paged-torch", "paged-native"]
FORMATS = {  # label -> engine options
    "int4 + rotation": {"kv_cache_dtype": "int4", "kv_rotation": "hadamard"},
    "int8": {"kv_cache_dtype": "int8"},
    "fp8": {"kv_cache_dtype": "fp8"},
    "int3, G 32, R 64, intact 32": {"kv_cache_dtype": "int3", "kv_key_group_tokens": 32,
                                    "kv_residual_tokens": 64, "kv_intact_tokens": 32},
    "int2 + rotation, G 32, R 32": {"kv_cache_dtype": "int2", "kv_rotation": "hadamard",
                                    "kv_key_group_tokens": 32, "kv_residual_tokens": 32},
}


@pytest.fixture(scope="module")
def factory(tiny_llama):
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_weights

    folder, _ = tiny_llama
    spec, weights = load_weights(folder, torch.float32)

    def build(**options):
        return LLMEngine(EngineConfig(model=str(folder), dtype="fp32", num_blocks=40, **options),
                         spec=spec, weights=weights)

    return build


def _tokens(n, seed=3):
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def _one_step(engine, tokens):
    return torch.cat([lp for _, lp in step_logprobs(engine, tokens, len(tokens), 0)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label", list(FORMATS))
def test_one_prefill_step_gives_the_logits_of_full_precision_kv(factory, label, backend):
    tokens = _tokens(150)
    want = _one_step(factory(kv_cache_dtype="bf16", attention=backend), tokens)
    assert torch.allclose(_one_step(factory(kv_cache_dtype="fp32", attention=backend), tokens),
                          want, atol=1e-5)
    got = _one_step(factory(attention=backend, **FORMATS[label]), tokens)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


def _roundtrip(codec, x):
    """Blocks x [n, bs, kv_heads, D] (whole key groups) as the codec stores and reads them."""
    if isinstance(codec, GroupedKeys):
        k, bs = codec.group_blocks, x.shape[1]
        whole = x.reshape(-1, k * bs, *x.shape[2:])
        return codec.whole.decode(codec.whole.encode(whole), x.dtype).reshape(x.shape)
    return codec.decode(codec.encode(x), x.dtype)


def _as_pooled(store, layer, keys, values, sealed):
    """[kv_heads, L, D] K and V with blocks [intact, sealed) through the layer's codecs."""
    bs, lo = store.block_size, store.intact_blocks
    if sealed <= lo:
        return keys, values
    out = []
    rotation = store.rotation
    for x, codec in ((keys, store.key_codecs[layer]), (values, store.value_codec)):
        blocks = x[:, lo * bs: sealed * bs].transpose(0, 1)  # [tokens, kv_heads, D]
        blocks = blocks.reshape(sealed - lo, bs, *blocks.shape[1:])
        if rotation is not None:
            blocks = blocks @ rotation
        blocks = _roundtrip(codec, blocks)
        if rotation is not None:
            blocks = blocks @ rotation.T
        x = x.clone()
        x[:, lo * bs: sealed * bs] = blocks.reshape(-1, *blocks.shape[2:]).transpose(0, 1)
        out.append(x)
    return out[0], out[1]


def _transformers_steps(hf, engine, tokens, steps):
    """Logits [rows, vocab] of each step (start, n) from transformers, its cache holding what
    the engine's pool holds when the step attends (module docstring): the blocks sealed by
    the end of the step, but for those the step writes."""
    from transformers import DynamicCache

    store, bs = engine.runner.store, engine.config.block_size
    keys, values, logits = [], [], []  # per layer [kv_heads, L, D]: every token as computed
    for start, n in steps:
        end = start + n
        sealed = min(store.sealed_blocks(end), start // bs)
        cache = DynamicCache()
        for layer in range(len(keys)):
            cache.update(*(x[None] for x in _as_pooled(store, layer, keys[layer],
                                                        values[layer], sealed)), layer)
        with torch.no_grad():
            out = hf(torch.tensor([tokens[start:end]]), past_key_values=cache,
                     position_ids=torch.arange(start, end)[None], use_cache=True)
        new = [(layer.keys[0, :, start:end], layer.values[0, :, start:end])
               for layer in out.past_key_values.layers]
        keys = [torch.cat([*keys[i:i + 1], k], 1) for i, (k, _) in enumerate(new)]
        values = [torch.cat([*values[i:i + 1], v], 1) for i, (_, v) in enumerate(new)]
        logits.append(out.logits[0])
    return logits


def _engine_steps(engine, tokens, steps, prompt):
    """Logits of each step (start, n) of one request whose prompt is ``tokens[:prompt]`` (a
    one-token step after it is a decode)."""
    req = Request("r", tokens[:prompt], SamplingParams(max_tokens=1))
    req.output_token_ids = list(tokens[prompt:])
    req.retention = engine.retention_state(engine.config.retention)
    kv, logits = engine.scheduler.kv, []
    try:
        for start, n in steps:
            assert kv.allocate_slots(req, n)
            hidden = engine.runner.hidden_states([_Chunk(req, n)])
            req.num_computed_tokens += n
            logits.append(engine.model.compute_logits(hidden))
    finally:
        kv.free(req)
    return logits


class _Chunk:
    def __init__(self, request, n):
        self.request, self.num_new_tokens = request, n


STEPS = [(0, 70), (70, 80), (150, 1), (151, 1), (152, 1), (153, 1)]
"""A prompt of 150 tokens in two prefill steps (the second starts inside block 4), then four
decodes (none completes a block)."""


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label", [  # int8 and fp8 in the slow suite
    pytest.param(label, marks=pytest.mark.slow) if label in ("int8", "fp8") else label
    for label in FORMATS])
def test_chunked_prefill_and_decodes_equal_transformers_over_the_pooled_cache(
        factory, tiny_llama, label, backend):
    _, hf = tiny_llama
    engine = factory(attention=backend, **FORMATS[label])
    tokens = _tokens(154, seed=11)
    want = _transformers_steps(hf, engine, tokens, STEPS)
    got = _engine_steps(engine, tokens, STEPS, 150)
    for (start, _), w, g in zip(STEPS, want, got):
        assert torch.allclose(g, w, atol=1e-4), (start, float((g - w).abs().max()))
