"""Weight loader and tokenizer: GGUF (dequantization, names, rotary un-permutation, cache) and
Hugging Face folders, checked against transformers, llama.cpp's converter formula and hand math."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from kvledger.errors import ConfigError, ModelNotFoundError, UnsupportedModelError
from kvledger.model.weights import gguf_tensors
from kvledger.model.weights.gguf_tensors import unpermute_rotary
from kvledger.model.weights.loader import load_tokenizer, load_weights


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """A fresh KVLEDGER_CACHE per test, removed afterwards (the bundled model's is 538 MB)."""
    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "cache"))
    yield tmp_path / "cache"
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def _q8_0(rng, rows: int, cols: int):
    """Hand-made Q8_0 data: per 32 values one fp16 scale d then 32 int8 q; value = d * q.

    Returns (raw uint8 [rows, cols / 32 * 34], expected float32 [rows, cols]).
    """
    d = rng.uniform(0.01, 0.1, size=(rows, cols // 32)).astype(np.float16)
    q = rng.integers(-127, 128, size=(rows, cols // 32, 32)).astype(np.int8)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1)
    expected = d.astype(np.float32)[..., None] * q.astype(np.float32)
    return raw.reshape(rows, -1), expected.reshape(rows, cols)


def _q4_k(rng, rows: int, cols: int):
    """Hand-made Q4_K rows of 256 values (ggml dequantize_row_q4_K) with one scale S and min M
    for all 8 sub-blocks: value = d * S * q - dmin * M, q = low nibbles of bytes 32c..32c+31
    for values 64c..64c+31 and their high nibbles for values 64c+32..64c+63."""
    assert cols == 256  # one super-block per row
    s_, m_, d, dmin = 5, 3, np.float16(0.5), np.float16(0.25)
    scales = np.array([s_] * 4 + [m_] * 4 + [s_ | m_ << 4] * 4, dtype=np.uint8)
    qs = rng.integers(0, 256, size=(rows, 4, 32)).astype(np.uint8)
    head = np.concatenate([np.array([d, dmin]).view(np.uint8), scales])
    raw = np.concatenate([np.tile(head, (rows, 1)), qs.reshape(rows, 128)], axis=1)
    q = np.concatenate([qs & 0xF, qs >> 4], axis=2).reshape(rows, 256).astype(np.float32)
    return raw, np.float32(d) * s_ * q - np.float32(dmin) * m_


def _q6_k(rng, rows: int, cols: int):
    """Hand-made Q6_K rows of 256 values (ggml dequantize_row_q6_K) with qh = 0 and one int8
    scale s: value = d * s * (nibble - 32); in each half of 128 values, value l / l+32 / l+64 /
    l+96 take the low nibble of ql[l] / ql[l+32] and the high nibble of ql[l] / ql[l+32]."""
    assert cols == 256  # one super-block per row
    s_, d = -3, np.float16(0.125)
    ql = rng.integers(0, 256, size=(rows, 2, 2, 32)).astype(np.uint8)  # half, (l, l+32), l
    tail = np.concatenate(
        [
            np.zeros(64, np.uint8),
            np.full(16, s_, np.int8).view(np.uint8),
            np.array([d]).view(np.uint8),
        ]
    )
    raw = np.concatenate([ql.reshape(rows, 128), np.tile(tail, (rows, 1))], axis=1)
    q = np.concatenate([ql & 0xF, ql >> 4], axis=2).reshape(rows, 256).astype(np.float32)
    return raw, np.float32(d) * s_ * (q - 32)


@pytest.mark.parametrize(
    ("make", "qtype"),
    [
        (_q8_0, GGMLQuantizationType.Q8_0),
        (_q4_k, GGMLQuantizationType.Q4_K),
        (_q6_k, GGMLQuantizationType.Q6_K),
    ],
)
def test_dequantize_matches_hand_computation(tmp_path, gguf_kit, make, qtype):
    from gguf import GGUFReader

    rng = np.random.default_rng(3)
    raw, expected = make(rng, 3, 256)
    path = gguf_kit.write(tmp_path / "q.gguf", {"blk.0.ffn_up.weight": (raw, qtype)})
    (tensor,) = GGUFReader(path).tensors
    assert np.array_equal(gguf_tensors.dequantize(tensor), expected)


def test_unpermute_inverts_llamacpp_permute(gguf_kit):
    # One head of 4 rows: llama.cpp writes rotate-half rows (0, 1 | 2, 3) as pairs (0, 2, 1, 3).
    rows = np.arange(8.0)  # two heads
    assert gguf_kit.permute(rows, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert unpermute_rotary(np.array([0.0, 2, 1, 3, 4, 6, 5, 7]), 2).tolist() == rows.tolist()
    w = np.random.default_rng(1).standard_normal((3 * 64, 10))
    assert np.array_equal(unpermute_rotary(gguf_kit.permute(w, 3), 3), w)


def _tiny_gguf(tmp_path, gguf_kit, **kw):
    """Untied tiny llama GGUF: F32 + F16 embedding + hand-made Q8_0 gate; returns (path, hf)."""
    hf = gguf_kit.hf_weights(tied=False)
    hf["model.embed_tokens.weight"] = hf["model.embed_tokens.weight"].astype(np.float16)
    raw, gate = _q8_0(np.random.default_rng(2), *hf["model.layers.0.mlp.gate_proj.weight"].shape)
    hf["model.layers.0.mlp.gate_proj.weight"] = gate
    tensors = gguf_kit.to_gguf(hf)
    tensors["blk.0.ffn_gate.weight"] = (raw, GGMLQuantizationType.Q8_0)
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    return gguf_kit.write(tmp_path / "tiny.gguf", tensors, **kw), hf


def test_tiny_gguf_loads_hf_names_and_values(tmp_path, gguf_kit):
    path, hf = _tiny_gguf(tmp_path, gguf_kit)
    spec, state = load_weights(path, torch.float32)
    assert spec.tie_word_embeddings is False
    assert set(state) == set(hf)
    for name, value in hf.items():
        assert state[name].dtype == torch.float32 and state[name].is_contiguous()
        assert np.array_equal(state[name].numpy(), value), name


def test_qwen2_gguf_is_not_unpermuted_and_keeps_biases(tmp_path, gguf_kit):
    hf = gguf_kit.hf_weights()
    tensors = gguf_kit.to_gguf(hf)
    # qwen2 GGUFs keep the HF row order (NEOX RoPE): write q/k unpermuted, plus q/k/v biases.
    tensors["blk.0.attn_q.weight"] = hf["model.layers.0.self_attn.q_proj.weight"]
    tensors["blk.0.attn_k.weight"] = hf["model.layers.0.self_attn.k_proj.weight"]
    bias = np.arange(gguf_kit.TINY["hidden"], dtype=np.float32)
    tensors["blk.0.attn_q.bias"] = bias
    kv_rows = gguf_kit.TINY["kv_heads"] * gguf_kit.TINY["hidden"] // gguf_kit.TINY["heads"]
    tensors["blk.0.attn_k.bias"] = tensors["blk.0.attn_v.bias"] = np.ones(kv_rows, np.float32)
    path = gguf_kit.write(tmp_path / "q.gguf", tensors, arch="qwen2")
    spec, state = load_weights(path, torch.float32)
    assert spec.model_type == "qwen2" and spec.attention.qkv_bias and "lm_head.weight" not in state
    for name in ("q_proj.weight", "k_proj.weight"):
        full = f"model.layers.0.self_attn.{name}"
        assert np.array_equal(state[full].numpy(), hf[full])
    assert np.array_equal(state["model.layers.0.self_attn.q_proj.bias"].numpy(), bias)


def test_unsupported_tensor_type_is_named(tmp_path, gguf_kit):
    tensors = gguf_kit.to_gguf(gguf_kit.hf_weights())
    rows = gguf_kit.TINY["ffn"]
    # IQ4_NL: 18 bytes per 32 values (fp16 scale + 16 bytes of 4-bit indices).
    raw = np.zeros((rows, gguf_kit.TINY["hidden"] // 32 * 18), dtype=np.uint8)
    tensors["blk.0.ffn_up.weight"] = (raw, GGMLQuantizationType.IQ4_NL)
    path = gguf_kit.write(tmp_path / "iq.gguf", tensors)
    with pytest.raises(UnsupportedModelError, match=r"IQ4_NL.*blk\.0\.ffn_up\.weight"):
        load_weights(path, torch.float32)


def test_cache_round_trip(tmp_path, gguf_kit, monkeypatch):
    path, _ = _tiny_gguf(tmp_path, gguf_kit)
    weights_dir = tmp_path / "cache" / "weights"
    real_state_dict = gguf_tensors.gguf_state_dict

    def no_dequantize(*args, **kwargs):
        raise AssertionError("cache miss: the GGUF was dequantized again")

    spec, first = load_weights(path, torch.float32)
    _, bf16 = load_weights(path, torch.bfloat16)  # one cache file per dtype
    assert sorted(p.name.split("-")[-1] for p in weights_dir.iterdir()) == [
        "bfloat16.safetensors",
        "float32.safetensors",
    ]  # and no temp file left behind
    monkeypatch.setattr(gguf_tensors, "gguf_state_dict", no_dequantize)
    spec2, second = load_weights(path, torch.float32)
    _, bf16_again = load_weights(path, torch.bfloat16)
    assert spec2 == spec and spec2.extra == spec.extra
    assert set(second) == set(first) == set(bf16_again)
    for name in first:
        assert torch.equal(first[name], second[name]), name
        assert bf16_again[name].dtype == torch.bfloat16
        assert torch.equal(bf16_again[name], first[name].to(torch.bfloat16)), name
        assert torch.equal(bf16_again[name], bf16[name]), name
    # a corrupt cache entry is rebuilt, not an error
    fp32_file = next(weights_dir.glob("*-float32.safetensors"))
    fp32_file.write_bytes(b"garbage")
    monkeypatch.setattr(gguf_tensors, "gguf_state_dict", real_state_dict)
    rebuilt = load_weights(path, torch.float32)[1]
    assert torch.equal(rebuilt["model.norm.weight"], first["model.norm.weight"])
    monkeypatch.setattr(gguf_tensors, "gguf_state_dict", no_dequantize)
    load_weights(path, torch.float32)  # and the rebuilt entry is a hit again
    # a rewritten file gets a new key, so it is dequantized again
    os.utime(path, ns=(0, 0))
    with pytest.raises(AssertionError, match="cache miss"):
        load_weights(path, torch.float32)


def test_path_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model path not found"):
        load_weights(tmp_path / "nope.gguf", torch.float32)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 100)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_weights(junk, torch.float32)
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_weights(tmp_path, torch.float32)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors"):
        load_weights(tmp_path, torch.float32)
    with pytest.raises(ConfigError, match="no tokenizer in"):
        load_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_tokenizer(junk)


def _tiny_hf_model(config_cls, **kw):
    torch.manual_seed(0)
    config = config_cls(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **kw,
    )
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("family", "tied", "shard"),
    [("llama", True, None), ("llama", False, "40KB"), ("qwen2", False, None)],
)
def test_hf_folder_round_trip(tmp_path, family, tied, shard):
    from transformers import LlamaConfig, Qwen2Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    model = _tiny_hf_model(config_cls, tie_word_embeddings=tied)
    folder = tmp_path / "hf"
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
    spec, state = load_weights(folder, torch.float32)
    expected = model.state_dict()
    if tied:
        expected.pop("lm_head.weight")
    assert spec.model_type == family and spec.tie_word_embeddings is tied
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in state


# --- the bundled GGUF against transformers (the session's one transformers load: hf_oracle) ---


@pytest.fixture(scope="module")
def hf_bundled_state(hf_oracle):
    return hf_oracle.state_dict()


@pytest.mark.slow
def test_bundled_gguf_matches_transformers_uncached_and_cached(hf_bundled_state):
    for _ in ("dequantized", "from cache"):
        spec, state = load_weights("default", torch.float32)
        assert spec.tie_word_embeddings and "lm_head.weight" not in state
        packed = {n for n in state if ".q4_" in n}
        assert set(state) - packed == set(hf_bundled_state) - {"lm_head.weight"}
        q = "model.layers.0.self_attn.q_proj.weight"
        assert state[q].shape == (576, 576)
        assert (state[q] - hf_bundled_state[q]).abs().max() <= 1e-6
        for name, value in state.items():
            if name not in packed:
                assert (value - hf_bundled_state[name]).abs().max() <= 1e-6, name
        # the packed 4-bit form rebuilds transformers' dequantized weights: (q - 8) * s + z
        assert len(packed) == 3 * 7 * 30  # every Q4_1 projection of the 30 layers
        for stem in ("model.layers.0.self_attn.q_proj", "model.layers.29.self_attn.k_proj",
                     "model.layers.7.mlp.down_proj"):
            codes, scale, zero = (state[stem + p] for p in (".q4_codes", ".q4_scale", ".q4_zero"))
            rebuilt = (codes.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(
                32, 1)
            assert (rebuilt - hf_bundled_state[stem + ".weight"]).abs().max() <= 1e-6, stem


@pytest.mark.slow
def test_bundled_tokenizer_cache_keeps_chat_template(_private_cache, tmp_path):
    fresh = load_tokenizer("default")
    assert len(list((_private_cache / "tokenizers").iterdir())) == 1
    cached = load_tokenizer("default")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert cached.chat_template == fresh.chat_template
    assert cached.apply_chat_template(messages, add_generation_prompt=True) == (
        fresh.apply_chat_template(messages, add_generation_prompt=True)
    )
    text = "Hello world, <|im_start|>user\nhi<|im_end|>"
    assert cached(text).input_ids == fresh(text).input_ids
    assert fresh.convert_tokens_to_ids("<|im_end|>") == 2  # the GGUF's eos id
    cached.save_pretrained(tmp_path / "hf")  # an HF folder's tokenizer loads the same way
    assert load_tokenizer(tmp_path / "hf")(text).input_ids == fresh(text).input_ids


def test_corrupt_safetensors_next_to_a_valid_config_is_a_config_error(tmp_path):
    from kvledger.data import config_path
    from kvledger.errors import ConfigError

    shutil.copy(config_path("HuggingFaceTB__SmolLM2-135M"), tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"garbage\n")
    with pytest.raises(ConfigError, match="corrupt safetensors"):
        load_weights(tmp_path, torch.float32)
