"""No silently wrong model: what the engine runs matches transformers, the rest is refused.

Llama configs whose forward the engine does not implement (biases on o_proj or the MLP, an
activation other than SiLU) are refused by name before any weight is read; Qwen2's q/k/v
biases, which it implements, give transformers' logits (random non-zero biases: transformers
initialises them to zero, which would hide a bias the engine drops).
"""

from __future__ import annotations

import pytest
import torch

from kvledger.engine.model_load import build_model
from kvledger.engine.request import Request
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import UnsupportedModelError
from kvledger.model.families import ENGINE_MODEL_TYPES
from kvledger.model.weights.loader import load_weights

TOL = 1e-3
SIZES = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def _save(folder, config_cls, model_cls, **extra):
    torch.manual_seed(0)
    model = model_cls(config_cls(**SIZES, **extra)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize(("extra", "field"), [
    ({"attention_bias": True}, "o_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
])
def test_llama_forward_variants_the_engine_lacks_are_refused_by_name(tmp_path, extra, field):
    from transformers import LlamaConfig, LlamaForCausalLM

    _save(tmp_path, LlamaConfig, LlamaForCausalLM, **extra)
    with pytest.raises(UnsupportedModelError, match=field.replace("(", r"\(")):
        load_weights(tmp_path, torch.float32)


def test_qwen2_qkv_biases_match_transformers(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf_model = _save(tmp_path, Qwen2Config, Qwen2ForCausalLM)
    spec, weights = load_weights(tmp_path, torch.float32)
    assert spec.attention.qkv_bias and not spec.attention.o_bias
    runner = ModelRunner(build_model(spec, weights, torch.float32), None, 16)
    req = Request("r", [5, 17, 33, 2, 99, 100, 7, 64, 3], SamplingParams())
    logits = runner.execute([type("Chunk", (), {"request": req, "num_new_tokens": 9})()])
    with torch.no_grad():
        ref = hf_model(torch.tensor([req.all_token_ids])).logits[0, -1]
    assert float((logits[0] - ref).abs().max()) <= TOL


def test_a_family_the_engine_lacks_names_only_the_families_it_runs(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "olmo2", "num_hidden_layers": 2, "hidden_size": 32,
        "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 128, "max_position_embeddings": 128}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UnsupportedModelError) as err:
        load_weights(tmp_path, torch.float32)
    runs = ", ".join(ENGINE_MODEL_TYPES)
    assert runs.startswith("llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3_text, mixtral, "
                           "qwen3_moe, gpt_oss, deepseek_v2")
    assert f"(it runs {runs})" in str(err.value)


@pytest.mark.parametrize(("tensor", "field"), [("blk.0.attn_output.bias", "o_bias"),
                                               ("blk.0.ffn_down.bias", "mlp_bias")])
def test_a_gguf_with_biases_the_engine_lacks_is_refused(tmp_path, gguf_kit, tensor, field,
                                                        monkeypatch):
    import numpy as np

    monkeypatch.setenv("KVLEDGER_CACHE", str(tmp_path / "cache"))
    tensors = gguf_kit.to_gguf(gguf_kit.hf_weights())
    tensors[tensor] = np.ones(gguf_kit.TINY["hidden"], dtype=np.float32)
    path = gguf_kit.write(tmp_path / "b.gguf", tensors)
    with pytest.raises(UnsupportedModelError, match=field):
        load_weights(path, torch.float32)


def test_a_local_folder_of_a_plan_only_family_is_refused_by_name_before_its_weights(tmp_path):
    """Issue 61 item 13: a local qwen3_next folder got "lacks 'num_experts'", then (485cae7)
    "no *.safetensors weights in ...", where its catalogue id is refused by name."""
    import shutil

    from kvledger.data import config_path
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.model_load import load_model

    shutil.copy(config_path("Qwen__Qwen3-Next-80B-A3B-Thinking"), tmp_path / "config.json")
    with pytest.raises(UnsupportedModelError, match="model_type 'qwen3_next' .* cannot run"):
        load_model(EngineConfig(model=str(tmp_path)), torch.float32)
