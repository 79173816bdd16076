"""The bundled model (its layers Q4_1 in the GGUF) with every layer ``w4a8``, which holds each
weight repacked at load (``kvledger.device.cpu.repack``), against the same model whose
``w4a8`` products are computed here from the file's Q4 blocks as given to the kernel, before any
repacking (the scheme of ``w8a8.py``: activations rounded to int8 per block of 32,
``y = sum_b d (e sum c a + m sum a)``, summed in the kernel's documented fp32 order, so a near
tie between two tokens does not tell them apart): greedy tokens decoded step by step from a bf16
KV cache must be the same. A repacked code, scale or minimum in the wrong place changes the
tokens; the pre-repacking kernel gave the same 24 tokens (" Rome. The capital of Spain is
Madrid. ...").
"""

from __future__ import annotations

import pytest
import torch

from kvledger.device.cpu import w8a8
from kvledger.engine.kv.store import KVStore
from kvledger.engine.model_load import build_model
from kvledger.engine.request import Request
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.model.q4 import q4_dequantize
from kvledger.model.weights.loader import load_tokenizer, load_weights

FORMATS = {**dict.fromkeys(("qkv", "o", "gate_up", "down"), "w4a8"), "lm_head": "w8a8"}
PROMPT = "The capital of France is Paris. The capital of Italy is"


class _Chunk:
    def __init__(self, req, n):
        self.request, self.num_new_tokens = req, n


class _BlockProduct:
    """A w4a8 product computed here from the file-form Q4 blocks (no repacking), in the kernel's
    documented order (``interleaved_gemv.h``): per block, ``acc = fma(dot, e * d, acc)`` then
    ``acc = fma(m, d * A, acc)`` in fp32 (each fma as one rounding of the exact fp64 value)."""

    def __init__(self, qs, e, m):
        self.qs, self.e, self.m = qs, e, m
        self.packed = qs
        self.out_features, self.in_features = qs.shape[0], 2 * qs.shape[1]
        self.codes = q4_dequantize(qs, torch.ones_like(e), torch.zeros_like(m)).reshape(
            self.out_features, -1, 32).double()                          # [out, blocks, 32]

    def __call__(self, x):
        rows = x.shape[0]
        xb = x.float().reshape(rows, -1, 32)
        amax = xb.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        a = torch.round(xb * inv).clamp(-127, 127)                      # [rows, blocks, 32]
        d = (amax / 127)[..., 0]                                         # [rows, blocks]
        total = d * a.sum(-1)                                            # d * A, fp32
        dots = torch.einsum("rbi,obi->rbo", a.double(), self.codes)     # exact integers
        acc = torch.zeros(rows, self.out_features)
        for b in range(dots.shape[1]):
            ed = self.e[:, b] * d[:, b, None]                            # fp32 product
            acc = (dots[:, b] * ed.double() + acc.double()).float()
            acc = (self.m[:, b].double() * total[:, b, None].double() + acc.double()).float()
        return acc.to(torch.bfloat16)

    def blocks(self, ids=None):
        ids = torch.arange(self.out_features) if ids is None else ids
        return self.qs[ids], self.e[ids], self.m[ids]

    def dense_bf16(self):
        return q4_dequantize(self.qs, self.e, self.m).bfloat16()


def _greedy(model, spec, prompt: list[int], n: int) -> list[int]:
    store = KVStore(spec.num_layers, 8, 16, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    runner = ModelRunner(model, store, 16)
    req = Request("r", list(prompt), SamplingParams())
    req.block_table = [5, 2, 7, 0, 1, 3, 4, 6]
    logits = runner.execute([_Chunk(req, len(prompt))])
    req.num_computed_tokens = len(prompt)
    for _ in range(n):
        req.output_token_ids.append(int(logits[0].argmax()))
        logits = runner.execute([_Chunk(req, 1)])
        req.num_computed_tokens += 1
    return req.output_token_ids


@pytest.mark.slow
def test_greedy_tokens_of_the_repacked_layers_equal_the_files_blocks(monkeypatch):
    if w8a8.kernel() is None:
        pytest.skip("no native kernels here")
    prompt = load_tokenizer("default").encode(PROMPT)
    spec, weights = load_weights("default", torch.bfloat16)
    model = build_model(spec, weights, torch.bfloat16, attention="paged-native", formats=FORMATS)
    assert model.weight_formats == FORMATS
    got = _greedy(model, spec, prompt, 24)
    monkeypatch.setattr(w8a8.W8A8Kernel, "bind_q4", lambda self, qs, e, m: _BlockProduct(qs, e, m))
    spec, weights = load_weights("default", torch.bfloat16)
    reference = build_model(spec, weights, torch.bfloat16, attention="paged-native",
                            formats=FORMATS)
    assert got == _greedy(reference, spec, prompt, 24)
