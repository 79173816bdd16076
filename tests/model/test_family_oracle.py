"""Every family against transformers on the same weights (issue 34, item 8).

transformers builds a tiny random model of each family with every feature of the real model
switched on (``family_kit.FEATURES``; a sliding window of W = 16). The oracle recomputes the
whole sequence with transformers at every step; ours prefills in chunks into scattered blocks
and decodes through the paged KV store, for each attention backend: the max absolute fp32
logit difference stays <= 1e-4 at prefill and at 16 decode steps. The same check fails once
any one feature is switched off in our spec (so each feature is exercised), and holds for the
GGUF each architecture's converter writes and for a multimodal Gemma 3 folder.
"""

from __future__ import annotations

import pytest
import torch
from family_kit import FEATURES, W, hf_logits, make_tiny, redraw, write_gguf
from oracle_kit import (
    DECODE_STEPS,
    TOL,
    Chunk,
    dense_reference,
    scattered_diffs,
    seeded_prompt,
    tiny_models,
)

from kvledger.engine.attention import BACKENDS
from kvledger.engine.kv.store import KVStore
from kvledger.engine.model_load import build_model
from kvledger.engine.request import Request
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.model.weights.loader import load_weights
from kvledger.spec import FULL

FAMILIES = sorted(FEATURES)
tiny = tiny_models(make_tiny)


def _prompt(family: str, n: int | None = None) -> list[int]:
    """3W + 5 tokens; 70 for the long-LongRoPE model (past its 64 original positions)."""
    return seeded_prompt(n or (70 if family == "phi3-long" else 3 * W + 5))


def _diffs(spec, weights, hf, prompt, attention="reference", steps=DECODE_STEPS) -> list[float]:
    """Max |logit difference| per step (:func:`oracle_kit.scattered_diffs`, no step
    excepted: these families do not route)."""
    store = KVStore(spec.num_layers, 32, 16, spec.num_kv_heads, spec.head_dim, torch.float32)
    return scattered_diffs(spec, weights, store, prompt, dense_reference(hf), attention, steps)[0]


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny, family, attention):
    _, hf, spec, weights = tiny(family)
    diffs = _diffs(spec, weights, hf, _prompt(family), attention)
    assert max(diffs) <= TOL, diffs


def _no_window(spec):
    return {"layer_types": (FULL,) * spec.num_layers, "sliding_window": None}


ABLATIONS = {  # family -> feature -> the spec change that switches it off
    "qwen3": {"q/k norm": lambda s: {"qk_norm": False}, "window": _no_window},
    "phi3": {"partial rotary": lambda s: {"partial_rotary_factor": 1.0, "rope_scaling": {
        **s.rope.scaling, **{k: s.rope.scaling[k] + [1.0, 1.0]  # the pass-through dims turn
                             for k in ("short_factor", "long_factor")}}},
             "LongRoPE short factors": lambda s: {"rope_scaling": None}, "window": _no_window},
    "phi3-long": {"LongRoPE long factors": lambda s: {
        "rope_scaling": {**s.rope.scaling, "original_max_position_embeddings": 256}}},
    "gemma2": {"attention soft-cap": lambda s: {"attn_logit_softcapping": None},
               "final soft-cap": lambda s: {"final_logit_softcapping": None},
               "query_pre_attn_scalar": lambda s: {"query_pre_attn_scalar": None},
               "window": _no_window},
    "gemma3": {"local rope base": lambda s: {"rope_local_base_freq": None},
               "global linear scaling": lambda s: {"rope_scaling": None},
               "q/k norm": lambda s: {"qk_norm": False}, "window": _no_window},
}


@pytest.mark.parametrize("family,feature", [(f, x) for f in ABLATIONS for x in ABLATIONS[f]])
def test_the_oracle_fails_without_each_feature(tiny, family, feature):
    """The comparison above can fail: with one feature switched off it does, at prefill."""
    _, hf, spec, weights = tiny(family)
    spec = spec.with_fields(**ABLATIONS[family][feature](spec))
    assert _diffs(spec, dict(weights), hf, _prompt(family), steps=0)[0] > 100 * TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_as_the_converter_writes_it_matches_transformers(tmp_path, family):
    """The family's GGUF (llama.cpp's tensor names and metadata, Gemma's 1 + w norms, Phi-3's
    fused projections and LongRoPE factor tensors) loads to the same forward pass. Gemma's
    query_pre_attn_scalar is head_dim here: llama.cpp does not store it (module docstring of
    ``kvledger.spec.gguf_reader``)."""
    hf = make_tiny(family, tmp_path / "hf", seed=1, gguf_compatible=True)
    write_gguf(family, hf, tmp_path / "m.gguf")
    spec, weights = load_weights(tmp_path / "m.gguf", torch.float32)
    folder_spec, _ = load_weights(tmp_path / "hf", torch.float32)
    assert spec.layers.windows == folder_spec.layers.windows
    diffs = _diffs(spec, weights, hf, _prompt(family), steps=4)
    assert max(diffs) <= TOL, diffs


def test_multimodal_gemma3_folder_runs_its_text_model(tmp_path):
    """A Gemma-3-4B-style folder (``Gemma3ForConditionalGeneration``: text under
    ``language_model``, a vision tower beside it): the text model loads and matches
    transformers' logits for a text-only prompt."""
    import transformers as tf
    from family_kit import _config

    text = _config("gemma3").to_dict()
    vision = {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
              "patch_size": 14}
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(0)
    hf = redraw(tf.Gemma3ForConditionalGeneration(cfg).eval(), 0)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    spec, weights = load_weights(tmp_path, torch.float32)
    assert spec.model_type == "gemma3_text"
    assert not any("vision" in name for name in weights)
    diffs = _diffs(spec, weights, hf, _prompt("gemma3", 2 * W + 3), steps=2)
    assert max(diffs) <= TOL, diffs


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_fast_mode_tracks_the_fp32_oracle(tiny, family):
    """bf16 weights, activations and KV pool (the probe's weight formats, the native fused
    ops where they apply): logits within 5 % of their spread of transformers' fp32 ones."""
    folder, hf, _, _ = tiny(family)
    spec, weights = load_weights(folder, torch.bfloat16)
    model = build_model(spec, weights, torch.bfloat16)
    store = KVStore(spec.num_layers, 16, 16, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    req = Request("r", _prompt(family), SamplingParams())
    req.block_table = [4, 1, 9, 2, 11]
    logits = ModelRunner(model, store, 16).execute([Chunk(req, req.num_tokens)])
    ref = hf_logits(hf, req.all_token_ids)
    assert float((logits[0] - ref).abs().max()) <= 0.05 * float(ref.max() - ref.min())
