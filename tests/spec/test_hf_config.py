"""ModelSpec from Hugging Face config.json: every family's layout rules, defaults and errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from kvledger.data import configs_dir
from kvledger.errors import ConfigError
from kvledger.ledger.kv import kv_bytes_per_token
from kvledger.ledger.kv_format import KVFormatSpec

BF16 = KVFormatSpec("bf16")
from kvledger.ledger.params import count_params
from kvledger.model.families import spec_from_hf_config
from kvledger.spec import FULL, LINEAR, MLA, SLIDING, ConfigWarning

CONFIGS = configs_dir()


def load(name: str):
    return spec_from_hf_config(CONFIGS / f"{name}.json")


def write(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_explicit_head_dim_is_not_hidden_over_heads():
    spec = load("Qwen__Qwen3-30B-A3B")
    assert spec.head_dim == 128 != spec.hidden_size // spec.num_attention_heads
    assert load("openai__gpt-oss-20b").head_dim == 64 != 2880 // 64


def test_layer_placement_rules():
    gemma2 = load("google__gemma-2-9b").layers.types
    assert gemma2[:4] == (SLIDING, FULL, SLIDING, FULL) and Counter(gemma2)[FULL] == 21
    gemma3 = load("google__gemma-3-1b-it").layers.types  # every 6th layer is global
    assert [i for i, k in enumerate(gemma3) if k == FULL] == [5, 11, 17, 23]
    oss = load("openai__gpt-oss-20b").layers.types  # from the config's layer_types
    assert oss[:2] == (SLIDING, FULL) and Counter(oss) == {SLIDING: 12, FULL: 12}
    nxt = load("Qwen__Qwen3-Next-80B-A3B-Thinking").layers.types
    assert nxt[:4] == (LINEAR, LINEAR, LINEAR, FULL) and Counter(nxt)[FULL] == 12
    assert set(load("deepseek-ai__DeepSeek-V3").layers.types) == {MLA}
    assert set(load("mistralai__Mistral-7B-v0.1").layers.types) == {SLIDING}


def test_qwen2_use_sliding_window_false_means_no_window(tmp_path):
    assert set(load("Qwen__Qwen2.5-7B").layers.types) == {FULL}  # sliding_window 131072 ignored
    raw = json.loads((CONFIGS / "Qwen__Qwen2.5-7B.json").read_text())
    raw.update(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    spec = spec_from_hf_config(write(tmp_path, raw))
    assert Counter(spec.layers.types) == {FULL: 20, SLIDING: 8}
    assert spec.layers.sliding_window == 4096


def test_families_fields():
    ds = load("deepseek-ai__DeepSeek-V3")
    assert (ds.latent.kv_lora_rank, ds.latent.qk_rope_head_dim) == (512, 64)
    assert ds.experts.mlp_only_layers == (0, 1, 2)
    assert (ds.experts.count, ds.experts.per_token, ds.experts.shared_count) == (256, 8, 1)
    assert ds.weights_dtype == "fp8"
    gpt2 = load("openai-community__gpt2")
    assert (gpt2.num_layers, gpt2.hidden_size, gpt2.num_attention_heads) == (12, 768, 12)
    assert gpt2.intermediate_size == 4 * 768 and gpt2.tie_word_embeddings
    assert load("google__gemma-3-1b-it").eos_token_ids == (1, 106)
    assert load("google__gemma-2-9b").tie_word_embeddings  # Gemma2Config default
    mix = load("mistralai__Mixtral-8x7B-v0.1")
    experts = mix.experts
    assert (experts.count, experts.per_token, experts.intermediate_size) == (8, 2, 14336)


def test_text_config_nesting_gemma3_multimodal(tmp_path):
    """A Gemma-3-4B-style wrapper: the decoder under text_config, attention keys left to the
    Gemma3TextConfig defaults (8 heads, 4 KV heads, head_dim 256, pattern 6)."""
    cfg = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "sliding_window": 1024,
        },
        "vision_config": {"hidden_size": 1152},
    }
    spec = spec_from_hf_config(write(tmp_path, cfg))
    assert (spec.num_kv_heads, spec.head_dim, spec.layers.sliding_window) == (4, 256, 1024)
    assert kv_bytes_per_token(spec, BF16, 1, 16) == 34 * 2 * 4 * 256 * 2
    assert kv_bytes_per_token(spec, BF16, 1, 16, window_aware=True) == (34 // 6) * 2 * 4 * 256 * 2


def test_phi3_and_kimi_k2(tmp_path):
    """Phi-3-mini-4k (HF config values): uniform 2047 window, 3.8B params (card)."""
    phi3 = {
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32064,
        "max_position_embeddings": 4096,
        "sliding_window": 2047,
        "tie_word_embeddings": False,
    }
    spec = spec_from_hf_config(write(tmp_path, phi3))
    assert set(spec.layers.types) == {SLIDING} and spec.layers.sliding_window == 2047
    assert abs(count_params(spec).total / 1e9 - 3.82) / 3.82 < 0.01
    kimi = json.loads((CONFIGS / "deepseek-ai__DeepSeek-V3.json").read_text())
    kimi.update(model_type="kimi_k2", n_routed_experts=384, num_attention_heads=64)
    spec = spec_from_hf_config(write(tmp_path, kimi))
    assert kv_bytes_per_token(spec, BF16, 1, 16) == 61 * (512 + 64) * 2  # MLA latent, independent of heads


def test_unknown_model_type_goes_generic_with_a_warning(tmp_path):
    raw = json.loads((CONFIGS / "meta-llama__Llama-3.1-8B.json").read_text())
    raw["model_type"] = "my_llama"
    with pytest.warns(ConfigWarning, match="my_llama"):
        spec = spec_from_hf_config(write(tmp_path, raw))
    assert kv_bytes_per_token(spec, BF16, 1, 16) == 32 * 2 * 8 * 128 * 2


def test_missing_key_names_the_key_and_the_file(tmp_path):
    raw = json.loads((CONFIGS / "meta-llama__Llama-3.1-8B.json").read_text())
    del raw["num_hidden_layers"]
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError, match=r"num_hidden_layers") as err:
        spec_from_hf_config(path)
    assert str(path) in str(err.value)
    raw = json.loads((CONFIGS / "deepseek-ai__DeepSeek-V3.json").read_text())
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        spec_from_hf_config(write(tmp_path, raw))


@pytest.mark.parametrize("text", ["not json", "[1, 2]", "", "\xff\xfe"])
def test_not_a_json_object(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ConfigError, match=str(path)):
        spec_from_hf_config(path)


def test_truncated_config(tmp_path):
    text = (CONFIGS / "meta-llama__Llama-3.1-8B.json").read_text()
    path = tmp_path / "config.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ConfigError, match="not valid JSON"):
        spec_from_hf_config(path)


def test_bad_layer_types(tmp_path):
    raw = json.loads((CONFIGS / "openai__gpt-oss-20b.json").read_text())
    raw["layer_types"][0] = "chunked_attention"
    with pytest.raises(ConfigError, match="layer_types"):
        spec_from_hf_config(write(tmp_path, raw))


@pytest.mark.parametrize(("key", "value", "why"), [
    ("num_attention_heads", 0, r"num_attention_heads must be an integer in \[1, 2\^31\), got 0"),
    ("intermediate_size", -128, r"intermediate_size must be an integer in \[0, 2\^31\), got -128"),
    ("rope_scaling", "yes please", "'rope_scaling' must be an object, got 'yes please'"),
    ("rope_parameters", [1], "'rope_parameters' must be an object, got \\[1\\]")])
def test_an_impossible_field_is_a_config_error_naming_it(tmp_path, key, value, why):
    """Old code: ZeroDivisionError, a spec that allocated a negative size, ValueError and
    AttributeError tracebacks instead of the CLI's ``error:`` line."""
    raw = json.loads((CONFIGS / "HuggingFaceTB__SmolLM2-135M.json").read_text())
    with pytest.raises(ConfigError, match=why):
        spec_from_hf_config(write(tmp_path, {**raw, key: value}))
