"""Granite-4.0-H against transformers' ``GraniteMoeHybridForCausalLM`` on tiny random models with
every feature on: Mamba-2 layers (two groups, conv and projection biases) beside attention
layers without RoPE (``position_embedding_type`` ``nope``), the µP multipliers all away from 1
(embedding x 3, residual x 0.5, attention scale 0.1, logits / 2), the shared MLP alone (dense)
or beside 4 routed experts, top 2 (MoE); and the dense Granite 4.0 layout (RoPE on attention
layers). fp32 logits within 1e-4 at prefill (two chunks into scattered blocks) and 16 decode
steps, from the Hugging Face folder and from the GGUF llama.cpp's converter writes of it; the
engine's greedy tokens equal transformers' alone, batched, chunked, preempted and on a prefix hit
from a state checkpoint; each ablation (a multiplier left at 1, RoPE turned on a
``nope`` model, the shared MLP dropped beside the experts) fails the comparison."""

from __future__ import annotations

import os

import pytest
from family_kit import SHAPE, hf_greedy, save_tiny
from granite_gguf_kit import convert, write_gguf
from oracle_kit import (
    TOL,
    check_bf16_state_run,
    dense_reference,
    fp32_engine,
    hit_logprob_diff,
    router_reference,
    run_together,
    seeded_prompt,
    state_diffs,
    tiny_models,
)

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import ConfigError
from kvledger.model.families import check_runnable
from kvledger.model.layers.experts import Experts
from kvledger.spec import FULL, MAMBA

STEPS = 16
KINDS = ["mamba", "attention", "mamba", "mamba", "attention", "mamba"]
COMMON = {**{k: v for k, v in SHAPE.items() if k != "intermediate_size"},
          "num_hidden_layers": 6, "layer_types": KINDS, "mamba_n_heads": 4,
          "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_expand": 2,
          "mamba_conv_bias": True, "mamba_proj_bias": True, "max_position_embeddings": 512,
          "embedding_multiplier": 3.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5,
          "logits_scaling": 2.0, "position_embedding_type": "nope"}
CONFIGS = {
    "dense": COMMON | {"num_local_experts": 0, "num_experts_per_tok": 0, "intermediate_size": 96,
                       "shared_intermediate_size": 96, "tie_word_embeddings": True},
    "moe": COMMON | {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                     "shared_intermediate_size": 48, "tie_word_embeddings": False},
    "rope": COMMON | {"num_local_experts": 0, "num_experts_per_tok": 0, "intermediate_size": 96,
                      "shared_intermediate_size": 96, "position_embedding_type": "rope",
                      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                      "time_step_limit": (0.05, 0.6)},
}
"""``dense``: Granite-4.0-H-Micro's kind; ``moe``: -Tiny's; ``rope``: the dense Granite 4.0
models' RoPE on the attention layers (here beside Mamba layers), and dt clamped to
``time_step_limit``."""


def _make(name: str, folder):
    from transformers import GraniteMoeHybridConfig

    return save_tiny(GraniteMoeHybridConfig(**CONFIGS[name]), folder)


tiny = tiny_models(_make)


def _reference(hf, spec):
    return router_reference(hf, spec.experts.per_token) if spec.is_moe else dense_reference(hf)


def _diffs(tiny, name: str, prompt_len: int, steps: int = STEPS, spec=None):
    _, hf, read, weights = tiny(name)
    spec = spec or read
    return state_diffs(spec, weights, seeded_prompt(prompt_len), _reference(hf, read), steps)


def test_the_tiny_models_have_every_feature(tiny):
    dense, moe, rope = (tiny(name)[2] for name in ("dense", "moe", "rope"))
    assert dense.layers.types == (MAMBA, FULL, MAMBA, MAMBA, FULL, MAMBA)
    assert dense.rope.position_embedding_type == "nope"
    assert rope.rope.position_embedding_type == "rope"
    assert dense.mamba.n_groups == 2 and dense.mamba.proj_bias and dense.state.conv_bias
    assert (dense.mup.embedding_multiplier, dense.mup.residual_multiplier,
            dense.mup.logits_scaling, dense.attention_scale) == (3.0, 0.5, 2.0, 0.1)
    assert not dense.is_moe and dense.intermediate_size == 96 and dense.tie_word_embeddings
    assert (moe.experts.count, moe.experts.per_token, moe.experts.intermediate_size) == (4, 2, 32)
    assert (moe.experts.shared_count, moe.experts.shared_intermediate_size) == (1, 48)
    assert {check_runnable(s) for s in (dense, moe, rope)} == {"granitehybrid"}


@pytest.mark.parametrize("name,prompt_len", [("dense", 5), ("dense", 23), ("dense", 70),
                                             ("moe", 23), ("moe", 70), ("rope", 23)])
def test_logits_match_transformers(tiny, name, prompt_len):
    diffs, excepted = _diffs(tiny, name, prompt_len)
    print(f"{name}: steps excepted for a router tie: {excepted or 'none'}")
    assert len(diffs) > STEPS // 2, excepted
    assert max(diffs) < TOL, (diffs, excepted)


@pytest.mark.parametrize("field", ["embedding_multiplier", "residual_multiplier",
                                   "logits_scaling"])
def test_ablation_a_multiplier_left_at_one_fails(tiny, field):
    spec = tiny("dense")[2]
    ablated = spec.with_fields(**{field: 1.0})
    diffs, _ = _diffs(tiny, "dense", 23, steps=2, spec=ablated)
    assert max(diffs) > 100 * TOL, diffs


@pytest.mark.parametrize("fields", [{"attention_multiplier": None},
                                    {"position_embedding_type": "rope"}],
                         ids=["head-dim-scale", "rope-on"])
def test_ablation_attention_fails(tiny, fields):
    """The softmax scale head_dim ** -0.5 instead of attention_multiplier, or RoPE turned on
    the ``nope`` model's attention layers: the logits leave transformers'."""
    ablated = tiny("dense")[2].with_fields(**fields)
    diffs, _ = _diffs(tiny, "dense", 23, steps=2, spec=ablated)
    assert max(diffs) > 100 * TOL, diffs


def test_ablation_time_step_limit_dropped_fails(tiny):
    """dt left unclamped on the model whose config limits it to [0.05, 0.6]."""
    spec = tiny("rope")[2]
    assert spec.mamba.time_step_limit == (0.05, 0.6)
    diffs, _ = _diffs(tiny, "rope", 23, steps=2, spec=spec.with_fields(time_step_limit=(0.0, None)))
    assert max(diffs) > 100 * TOL, diffs


def test_ablation_shared_mlp_dropped_fails(tiny, monkeypatch):
    """The MoE layers' routed experts without the shared MLP beside them."""
    call = Experts.__call__

    def without_shared(self, x):
        shared, self.shared = self.shared, None
        try:
            return call(self, x)
        finally:
            self.shared = shared

    monkeypatch.setattr(Experts, "__call__", without_shared)
    diffs, _ = _diffs(tiny, "moe", 23, steps=2)
    assert max(diffs) > 100 * TOL, diffs


GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 16, "max_num_seqs": 4},  # batched, prompts over one chunk
    {"max_num_batched_tokens": 128, "max_num_seqs": 1},  # one at a time
    {"max_num_batched_tokens": 16, "max_num_seqs": 4, "num_blocks": 24},  # preempted
], ids=["batched-chunked", "alone", "preempted"])
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_engine_greedy_equals_transformers(tiny, name, options):
    folder, hf, spec, weights = tiny(name)
    prompts = [seeded_prompt(n) for n in (15, 16, 17, 70)]
    engine = fp32_engine(folder, spec, weights, block_size=4, **options)
    assert engine.states is not None
    assert run_together(engine, prompts, GREEDY) == [hf_greedy(hf, p, 8) for p in prompts]
    if "num_blocks" in options:
        assert engine.scheduler.num_preemptions > 0
    assert engine.states.num_free == engine.states.num_slots


def test_prefix_hit_from_a_checkpoint_keeps_the_tokens(tiny):
    """A second turn extending the first restores the Mamba-2 state from a checkpoint: the hit
    is counted, the tokens equal transformers', the logprobs within 1e-4."""
    folder, hf, spec, weights = tiny("dense")
    engine = fp32_engine(folder, spec, weights, block_size=4, max_num_batched_tokens=16)
    first = seeded_prompt(37)
    second = first + seeded_prompt(11)
    got = [run_together(engine, [p], GREEDY, first=i)[0] for i, p in enumerate((first, second))]
    assert got == [hf_greedy(hf, p, 8) for p in (first, second)]
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
    engine = fp32_engine(folder, spec, weights, block_size=4, max_num_batched_tokens=16)
    assert hit_logprob_diff(engine, hf) < TOL


def test_the_spec_fields_are_the_configs(tiny, tmp_path):
    """The multipliers and the position embedding as transformers' config holds them; a config
    without ``position_embedding_type`` (its default, None) has no RoPE, as its model computes."""
    import json

    from kvledger.model.families import spec_from_hf_config

    folder, hf, spec, _ = tiny("moe")
    assert (spec.mup.embedding_multiplier, spec.mup.residual_multiplier,
            spec.mup.logits_scaling, spec.attention.multiplier) == (
        hf.config.embedding_multiplier, hf.config.residual_multiplier,
        hf.config.logits_scaling, hf.config.attention_multiplier)
    saved = json.loads((folder / "config.json").read_text())
    del saved["position_embedding_type"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert spec_from_hf_config(tmp_path).rope.position_embedding_type == "nope"


def test_bf16_runs_with_the_device_formats(tiny):
    """The engine in bf16 over the MoE model's bf16 weights (the device's weight formats for the
    Mamba in_proj / out_proj, the attention and the experts): it runs, the state in bf16, and
    every slot comes back."""
    check_bf16_state_run(tiny("moe")[0])


@pytest.mark.parametrize("writer", ["gguf-py", "llama.cpp"])
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_gguf_as_the_converter_writes_it_matches_transformers(tiny, tmp_path, name, writer):
    """The ``granitehybrid`` GGUF of the tiny folder (``-exp(A_log)``, squeezed taps, grouped
    norm, split gate / up, permuted q / k, the multipliers as ``*_scale`` keys, no RoPE):
    read back, its logits are transformers' within 1e-4. ``llama.cpp``: the converter itself
    (``KVLEDGER_LLAMA_CPP_SRC``), else skipped; ``gguf-py``: its changes written here."""
    import shutil

    import torch

    from kvledger.model.weights.loader import load_weights

    folder, hf, read, _ = tiny(name)
    path = tmp_path / f"{name}.gguf"
    if writer == "gguf-py":
        write_gguf(folder, path)
    elif not convert(shutil.copytree(folder, tmp_path / "hf"), path):
        pytest.skip("KVLEDGER_LLAMA_CPP_SRC (llama.cpp's source tree) is not set")
    spec, weights = load_weights(path, torch.float32)
    assert spec.layers.types == read.layers.types and spec.mup == read.mup
    assert spec.rope.position_embedding_type == "nope" and spec.experts == read.experts
    assert abs(spec.attention_scale - 0.1) < 1e-7  # stored as float32
    diffs, _ = state_diffs(spec, weights, seeded_prompt(23), _reference(hf, spec), steps=4)
    assert max(diffs) < TOL, diffs


def test_a_gguf_missing_a_state_tensor_is_named(tiny, tmp_path):
    import torch

    from kvledger.model.weights.loader import load_weights

    path = tmp_path / "no_a.gguf"
    write_gguf(tiny("dense")[0], path, drop="blk.2.ssm_a")
    with pytest.raises(ConfigError, match=r"model\.layers\.2\.mamba\.A_log"):
        load_weights(path, torch.float32)


@pytest.mark.parametrize("field,value,message", [
    ("logits_scaling", "big", "'logits_scaling' must be a number"),
    ("logits_scaling", 0, "logits_scaling"),
    ("time_step_limit", [0.5, 0.1], "'time_step_limit' must be two numbers 0 <= lo <= hi")])
def test_a_bad_config_field_is_named(tiny, tmp_path, field, value, message):
    """A multiplier that is no number or 0 (the logits divided by it), a dt limit upside down:
    a ConfigError naming the field, before any weight is read."""
    import json

    from kvledger.model.families import spec_from_hf_config

    cfg = json.loads((tiny("dense")[0] / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        spec_from_hf_config(tmp_path)


def _tokenizer_gguf(reference, path) -> None:
    """A ``granitehybrid`` GGUF holding the tokenizer ``reference`` as llama.cpp's converter
    writes a BPE one (``_set_vocab_gpt2``: the tokens by id, their types, the merges, the
    pre-tokenizer's name, the special tokens, the chat template), through gguf-py's writer."""
    import json

    import gguf

    doc = json.loads(reference.backend_tokenizer.to_str())
    vocab = {i: t for t, i in reference.get_vocab().items()}
    special = {t.content for t in reference.added_tokens_decoder.values() if t.special}
    w = gguf.GGUFWriter(str(path), "granitehybrid")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([vocab[i] for i in range(len(vocab))])
    w.add_token_types([gguf.TokenType.CONTROL if vocab[i] in special else gguf.TokenType.NORMAL
                       for i in range(len(vocab))])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in doc["model"]["merges"]])
    w.add_bos_token_id(reference.bos_token_id)
    w.add_eos_token_id(reference.eos_token_id)
    w.add_chat_template(reference.chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


@pytest.mark.parametrize("writer", ["gguf-py", "llama.cpp"])
def test_a_gguf_tokenizer_loads_though_transformers_refuses_the_architecture(tmp_path, writer):
    """transformers' AutoTokenizer refuses a ``granitehybrid`` GGUF; the tokenizer is built
    from the file's own tokenizer metadata and encodes text, special tokens and the chat
    template as the tokenizer written into it does (the bundled one). ``gguf-py``: the metadata
    written here as the converter writes it; ``llama.cpp``: the converter's file of a tiny
    folder holding the tokenizer (the model's vocabulary its size)."""
    from transformers import GraniteMoeHybridConfig

    from kvledger.model.weights.loader import load_tokenizer

    reference, path = load_tokenizer("default"), tmp_path / "t.gguf"
    if writer == "gguf-py":
        _tokenizer_gguf(reference, path)
    elif not os.environ.get("KVLEDGER_LLAMA_CPP_SRC"):
        pytest.skip("KVLEDGER_LLAMA_CPP_SRC (llama.cpp's source tree) is not set")
    else:
        folder = tmp_path / "hf"
        save_tiny(GraniteMoeHybridConfig(**CONFIGS["dense"] | {"vocab_size": len(reference)}),
                  folder)
        reference.save_pretrained(folder)
        assert convert(folder, path)
    got = load_tokenizer(path)
    text = "Hello world!  The 12345 quick\n\nbrown fox's <|im_start|>user café 日本語"
    assert got.encode(text) == reference.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(messages, tokenize=False) == \
        reference.apply_chat_template(messages, tokenize=False)
    assert (got.eos_token, got.bos_token) == (reference.eos_token, reference.bos_token)
