"""Qwen3.5 against transformers' ``Qwen3_5ForCausalLM`` and Qwen3.5-MoE against
``Qwen3_5MoeForCausalLM`` on tiny random models with every feature on (gated DeltaNet layers
with 2 key heads serving 4 value heads, gated full attention with per-head q/k RMSNorm and a
partial rotary of 0.25, every norm of the residual stream and of q / k in the ``1 + w`` form,
untied head; the MoE model's 6 experts, top 2 renormalised, and a sigmoid-gated shared expert
on every layer): fp32 logits within 1e-4 at prefill (two chunks into scattered blocks) and 16
decode steps; the engine's greedy tokens equal transformers' alone, batched, chunked, preempted
and on a prefix hit restored from a state checkpoint; the multimodal ``qwen3_5`` folder reads
as its text model, stacked experts as per-expert ones; and each ablation (no output gate, plain
``w`` norms, the top-k not renormalised, the shared expert ungated) fails the comparison."""

from __future__ import annotations

import re

import pytest
from family_kit import SHAPE, hf_greedy, redraw, save_tiny
from llama_cpp_kit import convert
from oracle_kit import (
    TOL,
    check_bf16_state_run,
    check_hit_and_zero_state_ablation,
    dense_reference,
    fp32_engine,
    router_reference,
    run_together,
    seeded_prompt,
    state_diffs,
    tiny_models,
)
from qwen35_gguf_kit import write_gguf

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.model.families import check_runnable, model_class
from kvledger.model.layers.attention import SelfAttention
from kvledger.model.layers.mlp import GatedMLP, SigmoidGatedMLP
from kvledger.model.weights.loader import load_tokenizer
from kvledger.spec import FULL, LINEAR

STEPS = 16
TEXT = {**SHAPE, "head_dim": 16, "num_hidden_layers": 6, "full_attention_interval": 3,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 512, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25}}


MOE = {**{k: v for k, v in TEXT.items() if k != "intermediate_size"}, "num_experts": 6,
       "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "shared_expert_intermediate_size": 48}
"""Qwen3.5-MoE's kind: 6 experts, top 2 (renormalised), a gated shared expert wider than one
expert, on every layer."""


def _make(name: str, folder):
    """``qwen3_5_text``: the text model; ``qwen3_5_moe_text``: the MoE model; ``qwen3_5``: the
    multimodal model (a tiny vision tower, the decoder under ``model.language_model``)."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    if name == "qwen3_5_text":
        return save_tiny(Qwen3_5TextConfig(**TEXT), folder)
    if name == "qwen3_5_moe_text":
        return save_tiny(Qwen3_5MoeTextConfig(**MOE), folder)
    if name == "qwen3_5_text+tokenizer":
        tokenizer = load_tokenizer("default")
        model = save_tiny(Qwen3_5TextConfig(**TEXT | {"vocab_size": len(tokenizer)}), folder)
        tokenizer.save_pretrained(folder)
        return model
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": 64, "patch_size": 4, "temporal_patch_size": 2}
    config = Qwen3_5Config(text_config=TEXT, vision_config=vision, tie_word_embeddings=False)
    model = redraw(Qwen3_5ForConditionalGeneration(config).float().eval(), 0)
    model.save_pretrained(folder, safe_serialization=True)
    return model


tiny = tiny_models(_make)


def _diffs(tiny, prompt_len: int, steps: int = STEPS, name: str = "qwen3_5_text", spec=None):
    _, hf, read, weights = tiny(name)
    reference = router_reference(hf, read.experts.per_token) if read.is_moe \
        else dense_reference(hf)
    return state_diffs(spec or read, weights, seeded_prompt(prompt_len), reference, steps)


def test_the_tiny_model_has_every_feature(tiny):
    spec = tiny("qwen3_5_text")[2]
    assert spec.layers.types == (LINEAR, LINEAR, FULL) * 2
    assert spec.attention.qk_norm and spec.attention.output_gate
    assert spec.rotary_dim == 4 and not spec.tie_word_embeddings
    assert spec.linear.num_value_heads == 2 * spec.linear.num_key_heads
    assert check_runnable(spec) == "qwen3_5"


def test_the_tiny_moe_model_has_every_feature(tiny):
    spec = tiny("qwen3_5_moe_text")[2]
    assert spec.layers.types == (LINEAR, LINEAR, FULL) * 2
    assert all(spec.is_moe_layer(i) for i in range(spec.num_layers))
    ex = spec.experts
    assert (ex.count, ex.per_token, ex.intermediate_size, ex.norm_topk_prob) == (6, 2, 32, True)
    assert (ex.shared_count, ex.shared_intermediate_size, ex.shared_gate) == (1, 48, True)
    assert check_runnable(spec) == "qwen3_5"


@pytest.mark.parametrize("name,prompt_len", [
    ("qwen3_5_text", 5), ("qwen3_5_text", 23), ("qwen3_5_text", 70),
    ("qwen3_5_moe_text", 5), ("qwen3_5_moe_text", 23), ("qwen3_5_moe_text", 70)])
def test_logits_match_transformers(tiny, name, prompt_len):
    diffs, excepted = _diffs(tiny, prompt_len, name=name)
    print(f"{name}: steps excepted for a router tie: {excepted or 'none'}")
    assert len(diffs) > STEPS // 2, excepted
    assert max(diffs) < TOL, (diffs, excepted)


def test_the_multimodal_folder_reads_as_its_text_model(tiny):
    """``qwen3_5`` with a ``text_config`` and a vision tower: the tower's tensors are dropped,
    ``model.language_model.*`` read as the decoder, the logits transformers'."""
    import json

    folder = tiny("qwen3_5")[0]
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5"
    diffs, _ = _diffs(tiny, 23, steps=4, name="qwen3_5")
    assert max(diffs) < TOL, diffs


def test_ablation_no_output_gate_fails(tiny, monkeypatch):
    """The attention output not multiplied by sigmoid(gate): the logits leave transformers'."""
    monkeypatch.setattr(SelfAttention, "output_gate", lambda self, out, qkv: out)
    diffs, _ = _diffs(tiny, 23, steps=2)
    assert max(diffs) > 100 * TOL, diffs


def test_ablation_plain_norms_fails(tiny, monkeypatch):
    """The norms read as plain ``w`` instead of ``1 + w``: the logits leave transformers'."""
    monkeypatch.setattr(model_class(tiny("qwen3_5_text")[2]), "NORM_OFFSET", 0.0)
    diffs, _ = _diffs(tiny, 23, steps=2)
    assert max(diffs) > 100 * TOL, diffs


def test_ablation_moe_top_k_not_renormalised_fails(tiny):
    """The MoE router's top-k weights left as softmax probabilities (Qwen3-MoE's default
    without ``norm_topk_prob``): the logits leave transformers'."""
    spec = tiny("qwen3_5_moe_text")[2]
    diffs, _ = _diffs(tiny, 23, steps=2, name="qwen3_5_moe_text",
                      spec=spec.with_fields(norm_topk_prob=False))
    assert max(diffs) > 100 * TOL, diffs


def test_ablation_moe_shared_expert_ungated_fails(tiny, monkeypatch):
    """The shared expert added without its sigmoid gate: the logits leave transformers'."""
    monkeypatch.setattr(SigmoidGatedMLP, "__call__", GatedMLP.__call__)
    diffs, _ = _diffs(tiny, 23, steps=2, name="qwen3_5_moe_text")
    assert max(diffs) > 100 * TOL, diffs


def test_moe_stacked_experts_read_as_per_expert(tiny, tmp_path):
    """A checkpoint holding each layer's experts stacked (``mlp.experts.gate_up_proj``
    [experts, 2f, hidden], ``down_proj`` [experts, hidden, f]) loads the same weights as the
    per-expert one transformers saves."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from kvledger.model.weights.loader import load_weights

    folder, _, spec, weights = tiny("qwen3_5_moe_text")
    state = load_file(folder / "model.safetensors")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        parts = {kind: torch.stack([state.pop(f"{p}{e}.{kind}.weight")
                                    for e in range(spec.experts.count)])
                 for kind in ("gate_proj", "up_proj", "down_proj")}
        state[p + "gate_up_proj"] = torch.cat([parts["gate_proj"], parts["up_proj"]], dim=1)
        state[p + "down_proj"] = parts["down_proj"]
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    save_file(state, tmp_path / "model.safetensors")
    _, stacked = load_weights(tmp_path, torch.float32)
    assert stacked.keys() == weights.keys()
    assert all(torch.equal(stacked[k], weights[k]) for k in weights)


GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _case(tiny, name: str):
    folder, hf, spec, weights = tiny(name)
    prompts = [seeded_prompt(n) for n in (15, 16, 17, 70)]
    return folder, spec, weights, prompts, [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_5_moe_text"])
@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 16, "max_num_seqs": 4},  # batched, prompts over one chunk
    {"max_num_batched_tokens": 128, "max_num_seqs": 1},  # one at a time
    {"max_num_batched_tokens": 16, "max_num_seqs": 4, "num_blocks": 24},  # preempted
], ids=["batched-chunked", "alone", "preempted"])
def test_engine_greedy_equals_transformers(tiny, name, options):
    folder, spec, weights, prompts, expected = _case(tiny, name)
    engine = fp32_engine(folder, spec, weights, block_size=4, **options)
    assert engine.states is not None
    assert run_together(engine, prompts, GREEDY) == expected
    if "num_blocks" in options:
        assert engine.scheduler.num_preemptions > 0
    assert engine.states.num_free == engine.states.num_slots


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_prefix_hit_from_a_checkpoint_keeps_the_tokens(tiny, name):
    """A second turn extending the first restores the DeltaNet state from the checkpoint at
    the shared prefix's last checkpointed block: the hit is counted and the tokens equal
    transformers'."""
    folder, hf, spec, weights = tiny(name)
    engine = fp32_engine(folder, spec, weights, block_size=4, max_num_batched_tokens=16)
    first = seeded_prompt(37)
    second = first + seeded_prompt(11)
    got = [run_together(engine, [p], GREEDY, first=i)[0] for i, p in enumerate((first, second))]
    assert got == [hf_greedy(hf, p, 8) for p in (first, second)]
    assert engine.stats()["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("name", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_hit_logprobs_match_and_the_ablation_fails(tiny, monkeypatch, name):
    """After a hit the logprobs equal transformers' (within 1e-4); a hit that starts the
    DeltaNet and conv states from zeros instead of the checkpoint's copy leaves them."""
    check_hit_and_zero_state_ablation(*tiny(name), monkeypatch)


def test_bf16_runs_with_the_device_formats(tiny):
    """The engine in bf16 over the model's bf16 weights (the device's weight formats for the
    gated q / k / v / gate projection and the DeltaNet's in_proj): it runs, the state in bf16,
    and every slot comes back."""
    check_bf16_state_run(tiny("qwen3_5_text")[0])


# The converter on the MoE folder is not run: it fingerprints the tokenizer transformers builds
# for qwen3_5_moe (Qwen3_5Tokenizer), and no tokenizer at hand offline matches one it knows.
@pytest.mark.parametrize(("name", "writer"), [
    ("qwen3_5_text", "gguf-py"), ("qwen3_5_text", "gguf-py+mtp"), ("qwen3_5_text", "llama.cpp"),
    ("qwen3_5_moe_text", "gguf-py"), ("qwen3_5_moe_text", "gguf-py+mtp")])
def test_gguf_as_the_converter_writes_it_matches_transformers(tiny, tmp_path, name, writer):
    """The ``qwen35`` / ``qwen35moe`` GGUF of the tiny model (value heads tiled, ``-exp(A_log)``,
    ``1 + w`` norms but the DeltaNet's, squeezed taps, stacked experts, the shared expert and
    its gate): read back, its logits are transformers' within 1e-4. ``gguf-py``: the
    converter's changes written here (``+mtp``: with a multi-token-prediction block after the
    decoder, left out); ``llama.cpp``: the converter itself (``KVLEDGER_LLAMA_CPP_SRC``, else
    skipped) on the folder with the bundled tokenizer (the converter reads one; the model's
    vocabulary its size)."""
    import torch

    from kvledger.model.weights.loader import load_weights

    path = tmp_path / f"{name}.gguf"
    if writer == "llama.cpp":
        name += "+tokenizer"
        if not convert(tiny(name)[0], path, "--no-mtp"):
            pytest.skip("KVLEDGER_LLAMA_CPP_SRC (llama.cpp's source tree) is not set")
    else:
        write_gguf(tiny(name)[1], path, mtp_blocks=int(writer.endswith("+mtp")))
    _, hf, read, _ = tiny(name)
    spec, weights = load_weights(path, torch.float32)
    assert spec.layers.types == read.layers.types and spec.experts == read.experts
    assert spec.rotary_dim == read.rotary_dim == 4
    reference = router_reference(hf, read.experts.per_token) if read.is_moe \
        else dense_reference(hf)
    diffs, _ = state_diffs(spec, weights, seeded_prompt(23), reference, steps=4)
    assert max(diffs) < TOL, diffs


def test_ablation_gguf_value_heads_left_tiled_fails(tiny, tmp_path, monkeypatch):
    """A ``qwen35`` GGUF read with its value heads left in llama.cpp's tiled order: the logits
    leave transformers'."""
    import torch

    from kvledger.model.families import qwen3_5
    from kvledger.model.weights.loader import load_weights

    hf = tiny("qwen3_5_text")[1]
    path = tmp_path / "tiled.gguf"
    write_gguf(hf, path)
    monkeypatch.setattr(qwen3_5, "_untile", lambda x, dim, kh, width: x)
    spec, weights = load_weights(path, torch.float32)
    diffs, _ = state_diffs(spec, weights, seeded_prompt(23), dense_reference(hf), steps=2)
    assert max(diffs) > 100 * TOL, diffs


@pytest.mark.parametrize("tensor,named", [("blk.3.ssm_a", "model.layers.3.linear_attn.A_log"),
                                          ("blk.0.ssm_conv1d.weight",
                                           "model.layers.0.linear_attn.conv1d.weight")])
def test_a_gguf_missing_a_state_tensor_is_named(tiny, tmp_path, tensor, named):
    """A ``qwen35`` GGUF without one of the DeltaNet's state tensors: a ConfigError naming it
    (by its checkpoint name), before the model is built."""
    import torch

    from kvledger.errors import ConfigError
    from kvledger.model.weights.loader import load_weights

    path = tmp_path / "missing.gguf"
    write_gguf(tiny("qwen3_5_text")[1], path, drop=tensor)
    with pytest.raises(ConfigError, match=re.escape(repr(named))):
        load_weights(path, torch.float32)
