"""spec_from_gguf: the bundled file against its model card, and tiny GGUFs written by gguf."""

from __future__ import annotations

import pytest

from kvledger.errors import ConfigError, UnsupportedModelError
from kvledger.model.families import spec_from_gguf
from kvledger.paths import bundled_model_path
from kvledger.spec import FULL, SLIDING


def test_bundled_spec_matches_model_card():
    # SmolLM2-135M-Instruct config.json (model card) and the GGUF's tensor table.
    spec = spec_from_gguf(bundled_model_path())
    assert spec.model_type == "llama"
    assert (spec.num_layers, spec.num_attention_heads, spec.num_kv_heads) == (30, 9, 3)
    assert (spec.head_dim, spec.hidden_size, spec.intermediate_size) == (64, 576, 1536)
    assert (spec.vocab_size, spec.max_position_embeddings) == (49152, 8192)
    assert spec.rope.theta == 100000.0
    assert spec.norm.eps == 1e-5
    assert spec.tie_word_embeddings is True
    assert spec.rope.scaling is None
    assert not spec.attention.qkv_bias and not spec.attention.qk_norm
    assert spec.layers.types == (FULL,) * 30
    assert spec.bos_token_id == 1
    assert spec.eos_token_ids == (2,)  # <|im_end|> is the eos token itself
    # 134,515,008 elements: 49152*576 embedding + 30 layers + final norm (no output.weight).
    per_layer = 2 * 576 + 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536
    assert spec.gguf.tensor_elements == 49152 * 576 + 30 * per_layer + 576 == 134_515_008
    # Q8_0 embedding (34 bytes / 32 values), Q4_1 matrices (20 bytes / 32), F32 norms.
    matrices = 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536
    expected_bytes = 49152 * 576 // 32 * 34 + 30 * (matrices // 32 * 20 + 2 * 576 * 4) + 576 * 4
    assert spec.gguf.tensor_bytes == expected_bytes


def test_tiny_gguf_optional_keys(tmp_path, gguf_kit):
    tensors = gguf_kit.to_gguf(gguf_kit.hf_weights(tied=False))
    tokens = ["<unk>", "</s>", "a", "<|eot_id|>", "b", "<|end_of_text|>", "c", "d", "e", "f"]
    extra = {
        "attention.key_length": 24,  # head_dim != hidden / heads
        "rope.scaling.type": "linear",
        "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 16,
        "attention.sliding_window": 32,
        "general.name": "tiny",
    }
    path = gguf_kit.write(tmp_path / "t.gguf", tensors, arch="mistral", tokens=tokens, extra=extra)
    spec = spec_from_gguf(path)
    assert spec.name == "t" and spec.model_type == "mistral"  # the file stem, not general.name
    assert spec.head_dim == 24
    assert spec.tie_word_embeddings is False
    assert spec.rope.scaling == {
        "rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 16
    }
    assert spec.layers.sliding_window == 32 and spec.layers.types == (SLIDING,)
    assert spec.eos_token_ids == (1, 3, 5)
    assert spec.gguf.tensor_elements == sum(t.size for t in tensors.values())
    assert spec.gguf.tensor_bytes == 4 * spec.gguf.tensor_elements  # all F32


def test_head_dim_and_vocab_fallbacks(tmp_path, gguf_kit):
    tensors = gguf_kit.to_gguf(gguf_kit.hf_weights())
    path = gguf_kit.write(tmp_path / "t.gguf", tensors, omit=("vocab_size",))
    spec = spec_from_gguf(path)
    assert spec.head_dim == gguf_kit.TINY["hidden"] // gguf_kit.TINY["heads"]
    assert spec.vocab_size == gguf_kit.TINY["vocab"]  # length of tokenizer.ggml.tokens
    assert spec.tie_word_embeddings is True


def test_missing_key_names_key_and_file(tmp_path, gguf_kit):
    tensors = gguf_kit.to_gguf(gguf_kit.hf_weights())
    path = gguf_kit.write(tmp_path / "t.gguf", tensors, omit=("feed_forward_length",))
    with pytest.raises(ConfigError, match=r"llama\.feed_forward_length") as err:
        spec_from_gguf(path)
    assert str(path) in str(err.value)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model")
    with pytest.raises(ConfigError, match="not a GGUF file: .*model.gguf"):
        spec_from_gguf(path)


def test_unsupported_architecture(tmp_path, gguf_kit):
    path = gguf_kit.write(tmp_path / "t.gguf", {}, arch="mamba")
    with pytest.raises(UnsupportedModelError, match="mamba"):
        spec_from_gguf(path)
