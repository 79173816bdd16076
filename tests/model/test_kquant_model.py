"""A K-quant GGUF run from its own blocks (issue 42): ``fixtures/tiny-q4_k_m.gguf``, a small
Llama trained on Python's ``pydoc_data.topics`` and quantized to Q4_K_M by llama.cpp's own tools
(``fixtures/make_kquant_fixture.py``), against the same file's weights dequantized to fp32 by the
``gguf`` library and run dense in fp32 (the reference the issue names).

The text is the last 10 % of the topics, which neither the tokenizer nor the model saw.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvledger.engine.kv.store import KVStore
from kvledger.engine.model_load import build_model
from kvledger.engine.request import Request
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.model.kquant import GGMLMatrix
from kvledger.model.weights.loader import load_tokenizer, load_weights

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-q4_k_m.gguf"
KQUANT = {c: "kquant-avx512" for c in ("qkv", "o", "gate_up", "down", "lm_head")}
"""The fastest native path this build has (a missing one falls back along the kquant formats)."""


class _Chunk:
    def __init__(self, req, n):
        self.request, self.num_new_tokens = req, n


@pytest.fixture(scope="module")
def text_ids() -> list[int]:
    from pydoc_data import topics

    text = "\n\n".join(topics.topics.values())
    return load_tokenizer(FIXTURE).encode(text[int(0.9 * len(text)):])[:384]


@pytest.fixture(scope="module")
def reference():
    """The file's weights dequantized by ``gguf`` to fp32, run dense in fp32."""
    from kvledger.model.families import family_of, spec_from_gguf_reader
    from kvledger.model.weights.gguf_tensors import gguf_state_dict
    from kvledger.spec import open_gguf

    reader = open_gguf(FIXTURE)
    spec = spec_from_gguf_reader(reader, FIXTURE)
    return build_model(spec, gguf_state_dict(reader, spec, family_of(spec)), torch.float32)


@pytest.fixture(scope="module")
def held():
    spec, weights = load_weights(FIXTURE, torch.bfloat16)
    return spec, weights, build_model(spec, weights, torch.bfloat16, formats=KQUANT)


def _all_logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits [T, vocab] at every position of ``ids`` (one causal pass, no KV cache)."""
    runner = ModelRunner(model, None, 16)
    req = Request("r", ids, SamplingParams())
    tokens, pos, meta, _ = runner.batch([_Chunk(req, len(ids))])
    return model.compute_logits(model.forward(tokens, pos, meta, None)).float()


def test_matrices_are_held_as_the_files_blocks_and_bytes(held):
    """Every matrix stays in its GGUF blocks, and the bytes held are the file's tensor bytes
    (counted by the ``gguf`` library from the file's header)."""
    spec, weights, model = held
    types = {w.type_name for w in weights.values() if isinstance(w, GGMLMatrix)}
    assert {"Q4_K", "Q6_K"} <= types
    assert all(isinstance(w, GGMLMatrix) or w.dim() == 1 for w in weights.values())
    assert model.weight_bytes == spec.gguf.tensor_bytes


def test_next_token_kl_against_the_dequantized_fp32_model(held, reference, text_ids):
    """Mean KL(reference || held) over 384 positions of unseen text at most 0.01 (issue 42)."""
    ref = torch.log_softmax(_all_logits(reference, text_ids), -1)
    ours = torch.log_softmax(_all_logits(held[2], text_ids), -1)
    kl = (ref.exp() * (ref - ours)).sum(-1)
    assert float(kl.mean()) <= 0.01, float(kl.mean())


def test_greedy_decode_from_the_kv_cache_follows_the_reference(held, reference, text_ids):
    """32 greedy tokens decoded step by step from a bf16 KV cache with the native kernels
    equal those of the fp32 reference recomputed without a cache."""
    spec, _, model = held
    store = KVStore(spec.num_layers, 8, 16, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    runner = ModelRunner(model, store, 16)
    prompt = text_ids[:64]
    req = Request("r", list(prompt), SamplingParams())
    req.block_table = [5, 2, 7, 0, 1, 3, 4, 6]
    logits = runner.execute([_Chunk(req, len(prompt))])
    req.num_computed_tokens = len(prompt)
    expected = list(prompt)
    for _ in range(32):
        req.output_token_ids.append(int(logits[0].argmax()))
        logits = runner.execute([_Chunk(req, 1)])
        req.num_computed_tokens += 1
        expected.append(int(_all_logits(reference, expected)[-1].argmax()))
    assert req.output_token_ids == expected[len(prompt):]


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_are_the_dequantized_weights_shards(held, rank):
    """Each rank's blocks (rows, whole-block columns; other columns dequantized) hold the same
    weights as the ``gguf``-dequantized matrix split the same way."""
    from kvledger.engine.parallel.shard import shard_weights

    spec, weights, _ = held
    dense = {n: w.dequantize(torch.float32) if isinstance(w, GGMLMatrix) else w.float()
             for n, w in weights.items()}
    ours, expected = shard_weights(weights, spec, 2, rank), shard_weights(dense, spec, 2, rank)
    assert ours.keys() == expected.keys()
    for name, w in ours.items():
        got = w.dequantize(torch.float32) if isinstance(w, GGMLMatrix) else w.float()
        assert torch.equal(got, expected[name]), name
