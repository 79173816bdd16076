"""LFM2 against transformers' ``Lfm2ForCausalLM`` on a tiny random model with every feature on
(short-conv layers with biases beside GQA attention layers with per-head q/k RMSNorm, untied
head): fp32 logits within 1e-4 at prefill and 16 decode steps, the prompt prefilled in two
chunks into scattered blocks, the conv windows carried in their slots; the engine's greedy
tokens equal transformers' alone, batched, chunked and preempted; the pool's bytes equal the
ledger's; and the ablation (a state not carried from step to step) fails the comparison."""

from __future__ import annotations

import pytest
import torch
from family_kit import SHAPE, hf_greedy, save_tiny
from oracle_kit import (
    TOL,
    check_hit_and_zero_state_ablation,
    dense_reference,
    fp32_engine,
    run_together,
    seeded_prompt,
    state_diffs,
    tiny_models,
)

from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.engine.kv.state_store import StepState, state_config
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import fixed_state_bytes
from kvledger.ledger.retention import RetentionSpec
from kvledger.spec import CONV, FULL

FEATURES = ["short-conv layers (3 taps) with in / conv / out biases",
            "GQA attention with per-head q/k RMSNorm on layers 1 and 4",
            "block_ff_dim auto-adjusted", "untied head"]
STEPS = 16


def _make(name: str, folder):
    from transformers import Lfm2Config

    config = Lfm2Config(**{k: v for k, v in SHAPE.items() if k != "intermediate_size"},
                        intermediate_size=144, block_multiple_of=16, num_hidden_layers=6,
                        full_attn_idxs=[1, 4], conv_bias=True, conv_L_cache=3,
                        max_position_embeddings=512, tie_word_embeddings=False)
    return save_tiny(config, folder)


tiny = tiny_models(_make)


def _diffs(tiny, prompt_len: int, steps: int = STEPS):
    _, hf, spec, weights = tiny("lfm2")
    return state_diffs(spec, weights, seeded_prompt(prompt_len), dense_reference(hf), steps)


def test_the_tiny_model_has_every_feature(tiny):
    spec = tiny("lfm2")[2]
    assert spec.layers.types == (CONV, FULL, CONV, CONV, FULL, CONV)
    assert spec.state.conv_bias and spec.attention.qk_norm and not spec.tie_word_embeddings
    assert spec.intermediate_size == 96  # 2/3 of 144, a multiple of 16


@pytest.mark.parametrize("prompt_len", [5, 23])
def test_logits_match_transformers(tiny, prompt_len):
    diffs, excepted = _diffs(tiny, prompt_len)
    assert not excepted and len(diffs) == STEPS + 1
    assert max(diffs) < TOL, diffs


def test_ablation_state_not_carried_fails(tiny, monkeypatch):
    """The conv windows dropped after each step (the state a chunk leaves is not written back):
    the second chunk and every decode start from zeros, and the logits leave transformers'."""
    monkeypatch.setattr(StepState, "scatter", lambda self, layer, state: None)
    diffs, _ = _diffs(tiny, 23, steps=2)
    assert max(diffs) > 100 * TOL, diffs


def _case(tiny):
    folder, hf, spec, weights = tiny("lfm2")
    lengths = (15, 16, 17, 33)
    prompts = [seeded_prompt(n) for n in lengths]
    return folder, spec, weights, prompts, [hf_greedy(hf, p, 8) for p in prompts]


GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.mark.parametrize("options", [
    {"max_num_batched_tokens": 16, "max_num_seqs": 4},  # batched, prompts over one chunk
    {"max_num_batched_tokens": 64, "max_num_seqs": 1},  # one at a time
    {"max_num_batched_tokens": 16, "max_num_seqs": 4, "num_blocks": 12},  # preempted
], ids=["batched-chunked", "alone", "preempted"])
def test_engine_greedy_equals_transformers(tiny, options):
    folder, spec, weights, prompts, expected = _case(tiny)
    engine = fp32_engine(folder, spec, weights, block_size=4, **options)
    assert engine.states is not None and engine.config.enable_prefix_caching
    got = run_together(engine, prompts, GREEDY)
    assert got == expected
    if "num_blocks" in options:
        assert engine.scheduler.num_preemptions > 0
    assert engine.states.num_free == engine.states.num_slots  # every slot given back


def test_pool_bytes_equal_the_ledger(tiny):
    """10 blocks, 3 slots and, with prefix caching, a checkpoint per interval of blocks: the
    state (2 KiB) over a block of 16 tokens (8 KiB) is one block, 10 checkpoints."""
    folder, _, spec, weights = tiny("lfm2")
    engine = fp32_engine(folder, spec, weights, block_size=16, num_blocks=10, max_num_seqs=3,
                         enable_prefix_caching=False)
    held = engine.store.nbytes + engine.states.nbytes
    assert held == 10 * engine.bytes_per_block + 3 * fixed_state_bytes(spec, 4)
    engine = fp32_engine(folder, spec, weights, block_size=16, num_blocks=10, max_num_seqs=3)
    assert engine.states.interval == 1 and engine.states.num_checkpoints == 10
    held = engine.store.nbytes + engine.states.nbytes
    assert held == 10 * engine.bytes_per_block + (3 + 10) * fixed_state_bytes(spec, 4)
    assert engine.bytes_per_block == 16 * 2 * 2 * 2 * 16 * 4  # 2 attention layers, fp32
    assert engine.states.nbytes == 13 * 4 * (64 * 2) * 4  # 4 conv layers, window of 2


def test_state_models_refuse_by_name(tiny):
    spec = tiny("lfm2")[2]
    with pytest.raises(InvalidParameterError, match="tensor-parallel-size.*state layers"):
        state_config(EngineConfig(tensor_parallel_size=2), spec)
    with pytest.raises(InvalidParameterError, match="no-kv-cache"):
        state_config(EngineConfig(use_kv_cache=False), spec)
    with pytest.raises(InvalidParameterError, match="speculative_config.*state layers"):
        state_config(EngineConfig(speculative_config={"method": "ngram"}), spec)
    state_config(EngineConfig(), spec)  # nothing refused


def test_tiers_and_evicting_retention_refused(tiny, tmp_path):
    folder, _, spec, weights = tiny("lfm2")
    with pytest.raises(InvalidParameterError, match="KV tiers.*lfm2"):
        fp32_engine(folder, spec, weights, kv_disk_dir=str(tmp_path / "tier"))
    engine = fp32_engine(folder, spec, weights)
    with pytest.raises(InvalidParameterError, match="state layers"):
        engine.add_request("r", [5, 6, 7], SamplingParams(kv_policy=RetentionSpec(
            "sinks", window=32, sinks=4)))


def test_the_bill_shows_state_beside_kv(tiny):
    """``kvledger generate``'s figures: one slot of the state tensors equals the ledger's
    state bytes per sequence (4 conv layers x 64 channels x 2 steps x 4 bytes)."""
    from kvledger.commands.generate_report import request_figures

    folder, _, spec, weights = tiny("lfm2")
    engine = fp32_engine(folder, spec, weights)
    engine.add_request("r", seeded_prompt(9), SamplingParams(max_tokens=3))
    out = None
    while engine.has_unfinished_requests():
        out = [o for o in engine.step() if o.finished] or out
    f = request_figures(engine, out[0])
    assert f["state_bytes_held"] == f["state_bytes_ledger"] == 4 * 64 * 2 * 4
    assert engine.stats()["state_pool_bytes"] == engine.states.nbytes


def test_bf16_state_in_bf16(tiny):
    """The engine in bf16 over the model's bf16 weights (the device's weight formats): the
    state in bf16, priced at 2 bytes an element."""
    from kvledger.model.weights.loader import load_weights

    folder = tiny("lfm2")[0]
    spec, weights = load_weights(folder, torch.bfloat16)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="bf16", max_num_seqs=2),
                       spec=spec, weights=weights)
    assert engine.states.conv[0].dtype == torch.bfloat16
    assert engine.states.row_bytes == fixed_state_bytes(spec, 2)
    slots, checkpoints = engine.states.num_slots, engine.states.num_checkpoints
    assert engine.states.nbytes == (slots + checkpoints) * fixed_state_bytes(spec, 2)
    got = run_together(engine, [seeded_prompt(20), seeded_prompt(7)],
                       SamplingParams(max_tokens=4, temperature=0.0))
    assert [len(t) for t in got] == [4, 4]


def _write_gguf(hf, path) -> None:
    """``hf`` as llama.cpp's converter writes an LFM2 (``conversion/lfm2.py``): gguf-py's
    tensor names, the conv taps squeezed to [hidden, taps], KV heads per layer (0 on a conv
    layer), ``shortconv.l_cache``, the adjusted ``feed_forward_length``."""
    import gguf
    import numpy as np

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "lfm2")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, cfg.num_hidden_layers)
    meta = {"block_count": cfg.num_hidden_layers, "context_length": 512,
            "embedding_length": cfg.hidden_size, "feed_forward_length": 96,
            "attention.head_count": cfg.num_attention_heads,
            "attention.head_count_kv": [cfg.num_key_value_heads if t != "conv" else 0
                                        for t in cfg.layer_types],
            "rope.freq_base": 1e6, "attention.layer_norm_rms_epsilon": cfg.norm_eps,
            "vocab_size": cfg.vocab_size, "shortconv.l_cache": cfg.conv_L_cache}
    for key, value in meta.items():
        full = f"lfm2.{key}"
        if isinstance(value, list):
            w.add_array(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    for hf_name, tensor in hf.state_dict().items():
        stem, _, kind = hf_name.rpartition(".")
        data = tensor.float().numpy().astype(np.float32)
        if "conv.conv" in hf_name and data.ndim == 3:
            data = data.squeeze(1)
        w.add_tensor(f"{names.get_name(stem)}.{kind}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_as_llama_cpp_writes_it_gives_the_same_tokens(tiny, tmp_path):
    from kvledger.model.weights.loader import load_weights

    _, hf, _, _ = tiny("lfm2")
    path = tmp_path / "lfm2.gguf"
    _write_gguf(hf, path)
    spec, weights = load_weights(path, torch.float32)
    assert spec.layers.types == (CONV, FULL, CONV, CONV, FULL, CONV) and spec.state.conv_bias
    prompts = [seeded_prompt(n) for n in (9, 21)]
    engine = fp32_engine(path, spec, weights, max_num_batched_tokens=16)
    assert run_together(engine, prompts, GREEDY) == [hf_greedy(hf, p, 8) for p in prompts]


def _two_turns(engine, hf, first: list[int], second: list[int]) -> tuple[list, list]:
    """The greedy tokens of ``first`` then ``second`` (one after the other, so the second can
    hit the first's blocks), and transformers' for both."""
    got = [run_together(engine, [p], GREEDY, first=i)[0] for i, p in enumerate((first, second))]
    return got, [hf_greedy(hf, p, 8) for p in (first, second)]


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefix_hits_from_checkpoints_keep_the_tokens(tiny, block_size):
    """A second turn that extends the first hits its blocks up to the last checkpoint (every
    ``interval`` blocks and the first prompt's last full block) and restores the state there:
    greedy tokens equal transformers', and the hit is counted."""
    folder, hf, spec, weights = tiny("lfm2")
    engine = fp32_engine(folder, spec, weights, block_size=block_size,
                         max_num_batched_tokens=16)
    first = seeded_prompt(37)
    second = first + seeded_prompt(11)
    got, expected = _two_turns(engine, hf, first, second)
    assert got == expected
    assert engine.stats()["prefix_cache_hit_tokens"] > 0


def test_a_short_prompt_hits_at_its_last_full_block(tiny):
    """A prompt shorter than one checkpoint interval (8 blocks of 4 here) still leaves a
    checkpoint at its last full block: the next turn hits 20 of its tokens, not 0."""
    folder, _, spec, weights = tiny("lfm2")
    engine = fp32_engine(folder, spec, weights, block_size=4, state_checkpoint_blocks=8)
    assert engine.states.interval == 8
    first = seeded_prompt(22)
    engine.add_request("a", first, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("b", first + seeded_prompt(5), GREEDY)
    engine.step()
    assert engine.scheduler.requests["b"].num_cached_tokens == 20


def test_hit_logprobs_match_and_the_ablation_fails(tiny, monkeypatch):
    """After a hit the logprobs equal transformers' (within 1e-4); a hit that starts from a
    zero state instead of the checkpoint's copy leaves them."""
    check_hit_and_zero_state_ablation(*tiny("lfm2"), monkeypatch)


def test_quantized_kv_on_the_attention_layers(tiny):
    """int8 KV on LFM2's attention layers beside the state slots: it runs, the pool holds
    quantized blocks, and every slot comes back."""
    folder, _, spec, weights = tiny("lfm2")
    engine = fp32_engine(folder, spec, weights, kv_cache_dtype="int8", block_size=16)
    assert engine.store.quantized and engine.states is not None
    got = run_together(engine, [seeded_prompt(40), seeded_prompt(9)], GREEDY)
    assert [len(t) for t in got] == [8, 8]
    assert engine.states.num_free == engine.states.num_slots
