"""Our forward pass against Hugging Face transformers on the same weights (fp32 logits).

The oracle recomputes the whole sequence with transformers at every step; ours prefills once and
then decodes through the paged KV store, so the comparison covers RoPE (with Llama-3 scaling),
GQA, the fused projections, the slot mapping and attention over block tables.
"""

from __future__ import annotations

import pytest
import torch
from oracle_kit import Chunk, dense_reference, logit_diffs

from kvledger.engine.attention import BACKENDS
from kvledger.engine.kv.store import KVStore
from kvledger.engine.model_load import build_model
from kvledger.engine.request import Request
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.model.weights.loader import load_weights

TOL = 1e-3
DECODE_STEPS = 16


def _paged_runner(spec, weights, num_blocks=64, block_size=16, attention="reference"):
    model = build_model(spec, weights, torch.float32, attention=attention)
    store = KVStore(
        spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, torch.float32
    )
    return ModelRunner(model, store, block_size)


def _compare_with_oracle(runner, hf_model, prompt, block_table, prefill_chunks):
    """Prefill in the given chunks, then greedy-decode; return the max |diff| per step."""
    req = Request("r", list(prompt), SamplingParams(max_tokens=DECODE_STEPS))
    req.block_table = list(block_table)
    return logit_diffs(runner, req, dense_reference(hf_model), prefill_chunks, DECODE_STEPS)[0]


@pytest.mark.parametrize("attention", BACKENDS)
def test_tiny_llama_logits_match_transformers(tiny_llama, attention):
    folder, hf_model = tiny_llama
    spec, weights = load_weights(folder, torch.float32)
    runner = _paged_runner(spec, weights, attention=attention)
    prompt = torch.randint(0, spec.vocab_size, (45,), generator=torch.Generator().manual_seed(1))
    # scattered, non-contiguous blocks and a chunked prefill (20 + 25 tokens)
    diffs = _compare_with_oracle(runner, hf_model, prompt.tolist(), [9, 3, 40, 7, 12], [20, 25])
    assert max(diffs) <= TOL, diffs


def test_tiny_llama_no_cache_matches_transformers(tiny_llama):
    folder, hf_model = tiny_llama
    spec, weights = load_weights(folder, torch.float32)
    runner = ModelRunner(build_model(spec, weights, torch.float32), None, 16)
    req = Request("r", [5, 17, 33, 2, 99, 100, 7], SamplingParams())
    logits = runner.execute([Chunk(req, req.num_tokens)])
    with torch.no_grad():
        ref = hf_model(torch.tensor([req.all_token_ids])).logits[0, -1]
    assert float((logits[0] - ref).abs().max()) <= TOL


@pytest.mark.slow
def test_bundled_gguf_logits_match_transformers(hf_oracle, bundled_path):
    spec, weights = load_weights(bundled_path, torch.float32)
    runner = _paged_runner(spec, weights)
    text = "The key-value cache stores the keys and values of every earlier token so that"
    from kvledger.model.weights.loader import load_tokenizer

    prompt = load_tokenizer(bundled_path).encode(text)
    diffs = _compare_with_oracle(runner, hf_oracle, prompt, list(range(10, 20)), [len(prompt)])
    assert max(diffs) <= TOL, diffs


def test_tiny_llama_bf16_paged_logits_track_fp32_oracle(tiny_llama):
    """bf16 path (weights, activations and KV pool in bf16) stays close to the fp32 oracle."""
    folder, hf_model = tiny_llama
    spec, weights = load_weights(folder, torch.bfloat16)
    model = build_model(spec, weights, torch.bfloat16)
    store = KVStore(spec.num_layers, 16, 16, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    runner = ModelRunner(model, store, 16)
    req = Request("r", list(range(10, 60)), SamplingParams())
    req.block_table = [4, 1, 9, 2]
    runner.execute([Chunk(req, 30)])
    req.num_computed_tokens = 30
    logits = runner.execute([Chunk(req, 20)])
    with torch.no_grad():
        ref = hf_model(torch.tensor([req.all_token_ids])).logits[0, -1]
    spread = float(ref.max() - ref.min())
    assert float((logits[0] - ref).abs().max()) <= 0.05 * spread


def test_decode_weight_bytes_count_the_files_matrices(bundled_path):
    """Dense fp32: 4 bytes per element of every matrix the GGUF stores for the layers' linears
    and the (tied) output head, counted by the gguf library from the file's tensor shapes."""
    import gguf

    matrices = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    reader = gguf.GGUFReader(str(bundled_path))
    names = {t.name: int(t.n_elements) for t in reader.tensors}
    head = names.get("output.weight", names["token_embd.weight"])
    elements = sum(n for name, n in names.items() if name.split(".")[-2] in matrices) + head
    spec, weights = load_weights(bundled_path, torch.float32)
    model = build_model(spec, weights, torch.float32, formats={c: "dense" for c in
                                                              ("qkv", "o", "gate_up", "down",
                                                               "lm_head")})
    assert model.decode_weight_bytes == 4 * elements
