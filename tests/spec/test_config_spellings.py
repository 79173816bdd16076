"""A config.json as transformers 4 wrote it and as transformers 5 writes it reads as the same
ModelSpec.

The transformers-5 spelling is made by transformers itself (the installed 5.x): the catalogue's
config (transformers 4) loaded with ``AutoConfig`` and written back with ``save_pretrained``:
``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` become ``rope_parameters`` (keyed by
``full_attention`` / ``sliding_attention`` for Gemma 3), ``num_experts`` becomes
``num_local_experts``, ``sliding_window_pattern`` gains ``layer_types``, ``torch_dtype``
becomes ``dtype``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvledger.data import config_path
from kvledger.model.families import spec_from_hf_config
from kvledger.spec import SLIDING

NAMES = ["meta-llama__Llama-3.1-8B", "mistralai__Mistral-7B-v0.1", "Qwen__Qwen2.5-7B",
         "Qwen__Qwen3-0.6B", "Qwen__Qwen3-8B", "Qwen__Qwen3-30B-A3B",
         "mistralai__Mixtral-8x7B-v0.1", "microsoft__Phi-3.5-mini-instruct",
         "microsoft__Phi-4-mini-instruct", "google__gemma-2-9b", "google__gemma-3-1b-it",
         "openai__gpt-oss-20b", "Qwen__Qwen3-Next-80B-A3B-Thinking", "deepseek-ai__DeepSeek-V3"]
GEMMA3_4B = {  # a Gemma-3-4B-style multimodal wrapper: global rope scaled x 8, local base 10k
    "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
    "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                    "num_hidden_layers": 34, "sliding_window": 1024,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                    "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
                    "query_pre_attn_scalar": 256},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
}


def _both(tmp_path, v4: dict):
    """(v4 spec, v5 spec, v5 json) of one config."""
    from transformers import AutoConfig

    old, new = tmp_path / "v4", tmp_path / "v5"
    old.mkdir()
    (old / "config.json").write_text(json.dumps(v4))
    AutoConfig.from_pretrained(old).save_pretrained(new)
    written = json.loads((new / "config.json").read_text())
    return spec_from_hf_config(old), spec_from_hf_config(new), written


def _differences(a, b) -> dict:
    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
            if f.name not in ("name", "source", "extra") and getattr(a, f.name) != getattr(b, f.name)}


@pytest.mark.parametrize("name", NAMES)
def test_transformers_4_and_5_spellings_give_one_spec(tmp_path, name):
    v4 = json.loads(config_path(name).read_text())
    old, new, written = _both(tmp_path, v4)
    assert "rope_parameters" in written and "rope_theta" not in written  # spelled the new way
    assert _differences(old, new) == {}


def test_moe_expert_count_under_both_names(tmp_path):
    v4 = json.loads(config_path("Qwen__Qwen3-30B-A3B").read_text())
    old, new, written = _both(tmp_path, v4)
    assert "num_local_experts" in written and "num_experts" not in written
    assert old.experts.count == new.experts.count == 128


def test_gemma3_keeps_its_global_scaling_and_local_base_in_both_spellings(tmp_path):
    old, new, written = _both(tmp_path, GEMMA3_4B)
    params = written["text_config"]["rope_parameters"]
    assert set(params) == {"full_attention", "sliding_attention"}
    for spec in (old, new):
        assert spec.rope.scaling == {"rope_type": "linear", "factor": 8.0}
        assert (spec.rope.theta, spec.rope.local_base_freq) == (1e6, 1e4)
        assert spec.layers.types.count(SLIDING) == 34 - 34 // 6
    assert _differences(old, new) == {}


def test_phi3_longrope_old_type_name_and_top_level_original_length(tmp_path):
    """Phi-3's transformers-4 ``rope_scaling`` has ``type`` (``su`` in the first releases) and
    ``original_max_position_embeddings`` at the top level."""
    v4 = json.loads(config_path("microsoft__Phi-3.5-mini-instruct").read_text())
    v4["rope_scaling"]["type"] = "su"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(v4))
    spec = spec_from_hf_config(path)
    assert spec.rope.scaling["rope_type"] == "longrope"
    assert spec.rope.scaling["original_max_position_embeddings"] == 4096
    assert len(spec.rope.scaling["long_factor"]) == 3072 // 32 // 2


def test_torch_dtype_and_dtype(tmp_path):
    v4 = json.loads(config_path("Qwen__Qwen3-0.6B").read_text())
    for key in ("torch_dtype", "dtype"):
        cfg = {k: v for k, v in v4.items() if k != "torch_dtype"} | {key: "float32"}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        assert spec_from_hf_config(tmp_path).weights_dtype == "fp32"


def test_the_forward_fields_of_real_configs():
    """Values from the configs themselves (and transformers' class defaults where a key is
    absent: Gemma 3's local base 10,000, its pattern 6)."""
    from kvledger.model.families import load_spec

    g2 = load_spec(config_path("google__gemma-2-9b"))
    assert (g2.attention.query_pre_attn_scalar, g2.attention.logit_softcapping,
            g2.final_logit_softcapping, g2.mlp.act, g2.norm.per_layer) == (
        256, 50.0, 30.0, "gelu_pytorch_tanh", 4)
    assert g2.layers.windows[:2] == (4096, None)
    g3 = load_spec(config_path("google__gemma-3-1b-it"))
    assert (g3.rope.theta, g3.rope.local_base_freq, g3.rope.scaling) == (1e6, 1e4, None)
    assert g3.layers.windows.count(512) == 22 and g3.layers.windows[5] is None
    assert g3.attention.qk_norm
    assert g3.attention.logit_softcapping is None and g3.final_logit_softcapping is None
    phi4 = load_spec(config_path("microsoft__Phi-4-mini-instruct"))
    assert (phi4.rope.partial_rotary_factor, phi4.rotary_dim) == (0.75, 96)
    assert len(phi4.rope.scaling["short_factor"]) == 96 // 2
    qwen = load_spec(config_path("Qwen__Qwen3-0.6B"))
    assert qwen.attention.qk_norm and qwen.layers.windows == (None,) * 28 and qwen.head_dim == 128
