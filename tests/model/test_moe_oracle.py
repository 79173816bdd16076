"""The MoE families against transformers on the same weights (issue 35, items 1 and 4).

transformers builds a tiny random model of each MoE family (``family_kit.MOE_FEATURES``: top-k
< experts, Qwen3-MoE's dense ``mlp_only_layers`` and ``decoder_sparse_step``, both routings'
normalisations, a window of W = 16). The oracle recomputes the whole sequence with transformers
at every step; ours prefills in two chunks into scattered blocks and decodes through the paged
store: the max absolute fp32 logit difference stays <= 1e-4 at prefill and at 16 decode steps.
A step is excepted when, at any position it depends on, some MoE layer's k-th and (k+1)-th
router probabilities (transformers' own, ``output_router_logits``) lie within 1e-5 (a tie the
two sides may break differently); the test lists those steps. The check fails with the
routing's normalisation or its k changed, holds for the GGUF llama.cpp's converter writes
(Mixtral as ``llama`` with expert tensors, ``qwen3moe``), and a decode step reads only the
chosen experts: the bytes it reads are the ledger's active parameters (less the embedding,
gathered by row, and the norms) at 4 bytes each.

gpt-oss (``family_kit.MOE_FEATURES["gpt_oss"]``) runs the same comparison with its sink logits,
biases, clamped SwiGLU, alternating window and YaRN, and each of them is shown to matter
(:data:`GPT_OSS_ABLATIONS`).
"""

from __future__ import annotations

import pytest
import torch
from family_kit import MOE_FEATURES, W, make_tiny, write_gguf
from oracle_kit import (
    DECODE_STEPS,
    TIE,
    TOL,
    Chunk,
    router_reference,
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
from kvledger.ledger.params import count_params
from kvledger.model.weights.loader import load_weights

FAMILIES = sorted(MOE_FEATURES)
tiny = tiny_models(make_tiny)


def _prompt(n: int = 3 * W + 5) -> list[int]:
    return seeded_prompt(n)


def _model(spec, weights, attention="reference"):
    return build_model(spec, dict(weights), torch.float32, attention=attention)


def _diffs(spec, weights, hf, prompt, attention="reference", steps=DECODE_STEPS):
    """(max |logit difference| per compared step, the excepted steps; a step is excepted for
    a router tie, :func:`oracle_kit.router_reference`), :func:`oracle_kit.scattered_diffs`."""
    store = KVStore(spec.num_layers, 32, 16, spec.num_kv_heads, spec.head_dim, torch.float32)
    return scattered_diffs(spec, weights, store, prompt,
                           router_reference(hf, spec.experts.per_token), attention, steps)


@pytest.mark.parametrize("attention", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny, family, attention):
    _, hf, spec, weights = tiny(family)
    assert 0 < spec.experts.per_token < spec.experts.count
    diffs, excepted = _diffs(spec, weights, hf, _prompt(), attention)
    print(f"{family}: steps excepted for a router tie within {TIE}: {excepted or 'none'}")
    assert len(diffs) > DECODE_STEPS // 2, excepted
    assert max(diffs) <= TOL, (diffs, excepted)


def test_the_tiny_models_have_what_the_features_say(tiny):
    """Qwen3-MoE's dense layer and sparse step reach the spec; each routing's normalisation."""
    assert tiny("qwen3_moe")[2].experts.mlp_only_layers == (2,)
    assert tiny("qwen3_moe-step2")[2].experts.mlp_only_layers == (0, 2)
    assert [tiny(f)[2].experts.norm_topk_prob for f in FAMILIES] == [True, True, True, False]


ABLATIONS = {  # the spec change that switches a routing feature off
    "normalisation": lambda s: {"norm_topk_prob": not s.experts.norm_topk_prob},
    "top-k": lambda s: {"num_experts_per_tok": s.experts.per_token + 1},
}


@pytest.mark.parametrize("family,feature", [(f, x) for f in FAMILIES for x in ABLATIONS])
def test_the_oracle_fails_without_each_feature(tiny, family, feature):
    """The comparison above can fail: with the routing changed it does, at prefill."""
    _, hf, spec, weights = tiny(family)
    changed = spec.with_fields(**ABLATIONS[feature](spec))
    assert _diffs(changed, weights, hf, _prompt(), steps=0)[0][0] > 100 * TOL


GPT_OSS_ABLATIONS = {  # (spec change, weights change) that switches a gpt-oss feature off
    "sink logits": ({}, lambda w: {k: v * 0 if k.endswith(".sinks") else v
                                   for k, v in w.items()}),
    "o_proj bias": ({}, lambda w: {k: v for k, v in w.items() if not k.endswith("o_proj.bias")}),
    "expert biases": ({}, lambda w: {k: v * 0 if ".experts." in k and k.endswith(".bias")
                                     else v for k, v in w.items()}),
    "swiglu clamp": ({"swiglu_limit": 1e4}, dict),
    "window": ({"layer_types": ("full_attention",) * 4}, dict),
    "yarn": ({"rope_scaling": None}, dict),
}


@pytest.mark.parametrize("feature", sorted(GPT_OSS_ABLATIONS))
def test_the_oracle_fails_without_each_gpt_oss_feature(tiny, feature):
    """gpt-oss's features each change the logits: the oracle above fails without one."""
    _, hf, spec, weights = tiny("gpt_oss")
    change, reweigh = GPT_OSS_ABLATIONS[feature]
    changed = spec.with_fields(**change)
    assert _diffs(changed, reweigh(weights), hf, _prompt(), steps=0)[0][0] > 100 * TOL


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_gguf_as_the_converter_writes_it_matches_transformers(tmp_path, family):
    """The family's GGUF (stacked ``ffn_*_exps`` and ``ffn_gate_inp``; Mixtral under the
    ``llama`` architecture with its q / k rows permuted; gpt-oss's ``attn_sinks``, biases and
    YaRN keys) loads to the same forward pass."""
    hf = make_tiny(family, tmp_path / "hf", seed=1, gguf_compatible=True)
    write_gguf(family, hf, tmp_path / "m.gguf")
    spec, weights = load_weights(tmp_path / "m.gguf", torch.float32)
    folder_spec, _ = load_weights(tmp_path / "hf", torch.float32)
    assert (spec.model_type, spec.experts.count, spec.experts.per_token, spec.experts.mlp_only_layers,
            spec.experts.intermediate_size) == (
        folder_spec.model_type, folder_spec.experts.count, folder_spec.experts.per_token,
        folder_spec.experts.mlp_only_layers, folder_spec.experts.intermediate_size)
    diffs, _ = _diffs(spec, weights, hf, _prompt(), steps=4)
    assert max(diffs) <= TOL, diffs


def _vector_params(spec) -> int:
    """The vectors' parameters (read whole, counted by the ledger as active; the model's
    figure counts matrices): the norms, and gpt-oss's biases (attention, router, k experts')
    and sink logits."""
    h, d = spec.hidden_size, spec.head_dim
    per_layer = spec.norm.per_layer * h + (2 * d if spec.attention.qk_norm else 0)
    if spec.model_type == "gpt_oss":
        per_layer += (spec.num_attention_heads + 2 * spec.num_kv_heads) * d + h  # q, k, v, o
        per_layer += spec.num_attention_heads + spec.experts.count  # sinks, router
        per_layer += spec.experts.per_token * (2 * spec.experts.intermediate_size + h)
    return spec.num_layers * per_layer + h


@pytest.mark.parametrize("family", FAMILIES)
def test_a_decode_step_reads_the_ledgers_active_parameters(tiny, family):
    """At batch 1 each decode step reads the attention, the dense MLPs, the LM head and per MoE
    layer its router and exactly k experts: 4 bytes x (the ledger's active parameters less
    the embedding and the vectors: norms, biases, sinks). Four sequences in one step read no more than the distinct
    experts they chose."""
    _, _, spec, weights = tiny(family)
    model = _model(spec, weights)
    layers = model.layers
    static = model.lm_head.nbytes + sum(
        lin.nbytes for layer in layers for block in (layer["attn"], layer["mlp"])
        if block not in model.experts for cls in ("qkv", "o", "gate_up", "down")
        for lin in block.linears(cls))
    params = count_params(spec)
    want = 4 * (params.active - params.embedding - _vector_params(spec))
    assert model.decode_weight_bytes == want
    store = KVStore(spec.num_layers, 32, 16, spec.num_kv_heads, spec.head_dim, torch.float32)
    runner = ModelRunner(model, store, 16)
    reqs = [Request(f"r{i}", _prompt(5 + i), SamplingParams(max_tokens=8)) for i in range(4)]
    for i, req in enumerate(reqs):
        req.block_table = [i]
        runner.execute([Chunk(req, req.num_tokens)])
        req.num_computed_tokens = req.num_tokens
    for _ in range(3):
        before = sum(ex.bytes_read for ex in model.experts)
        reqs[0].output_token_ids.append(7)
        runner.execute([Chunk(reqs[0], 1)])
        reqs[0].num_computed_tokens += 1
        assert static + sum(ex.bytes_read for ex in model.experts) - before == want
    before = [ex.bytes_read for ex in model.experts]
    for req in reqs:
        req.output_token_ids.append(9)
    runner.execute([Chunk(req, 1) for req in reqs])
    for ex, start in zip(model.experts, before):
        touched = (ex.bytes_read - start - ex.router.nbytes) // ex.expert_bytes
        assert spec.experts.per_token <= touched <= min(4 * spec.experts.per_token,
                                                          spec.experts.count)


@pytest.mark.parametrize("down", ["int8", "w8a8"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_experts_take_the_weight_formats_per_expert(tiny, family, down):
    """bf16 with int8 weights per expert (``gate_up`` w8a8 where the native kernel is built,
    else int8; ``down`` int8 or w8a8): every expert holds the format reported, and the logits
    stay within 5 % of their spread of transformers' fp32 ones. Experts given 20 rows or more
    run as a bf16 GEMM; with both classes w8a8 the others run as grouped native products
    (:meth:`Experts._grouped_add`, biases included): the prompt mixes both, a decode step is
    all grouped."""
    from kvledger.device.cpu.kernels import KERNELS
    from kvledger.model.linear import w8a8_ok

    folder, hf, _, _ = tiny(family)
    spec, weights = load_weights(folder, torch.bfloat16)
    model = build_model(spec, weights, torch.bfloat16,
                              formats={"gate_up": "w8a8", "down": down})
    held = {cls: fmt if w8a8_ok(width, KERNELS) else "int8" for cls, fmt, width in (
        ("gate_up", "w8a8", spec.hidden_size), ("down", down, spec.experts.intermediate_size))}
    assert {lin.format for ex in model.experts for lin in ex.gate_up} == {held["gate_up"]}
    assert {lin.format for ex in model.experts for lin in ex.down} == {held["down"]}
    assert (model.weight_formats["gate_up"], model.weight_formats["down"]) == (
        held["gate_up"], held["down"])
    assert all((None not in ex._grouped) == (set(held.values()) == {"w8a8"})
               for ex in model.experts)
    for ex in model.experts:
        for lin in ex.gate_up + ex.down:
            lin.use_gemm(20, "bf16")
    store = KVStore(spec.num_layers, 16, 16, spec.num_kv_heads, spec.head_dim, torch.bfloat16)
    req = Request("r", _prompt(), SamplingParams())
    req.block_table = [4, 1, 9, 2, 11]
    runner = ModelRunner(model, store, 16)
    logits, n = runner.execute([Chunk(req, req.num_tokens)])[0], req.num_tokens
    for token in (5, 17, 3):  # decode steps: one row per call, the batch-1 path
        ref, _ = router_reference(hf, spec.experts.per_token)(req.all_token_ids)
        assert float((logits - ref).abs().max()) <= 0.05 * float(ref.max() - ref.min())
        req.num_computed_tokens, n = req.num_computed_tokens + n, 1
        req.output_token_ids.append(token)
        logits = runner.execute([Chunk(req, 1)])[0]
