"""The family table: each model_type runs in its family's class, others are refused by name,
and a spec with a field value its family does not compute is refused naming the field."""

from __future__ import annotations

import pytest

from kvledger.data import config_path
from kvledger.errors import UnsupportedModelError
from kvledger.model.deepseek import DeepseekModel
from kvledger.model.families import FAMILIES, model_class
from kvledger.model.gemma import GemmaModel
from kvledger.model.gpt_oss import GptOssModel
from kvledger.model.llama import LlamaModel
from kvledger.model.moe import MoEModel
from kvledger.model.phi3 import Phi3Model
from kvledger.model.qwen3 import Qwen3Model
from kvledger.spec import load_spec


@pytest.mark.parametrize("name,cls", [
    ("meta-llama__Llama-3.1-8B", LlamaModel), ("mistralai__Mistral-7B-v0.1", LlamaModel),
    ("Qwen__Qwen2.5-7B", LlamaModel), ("HuggingFaceTB__SmolLM2-135M", LlamaModel),
    ("Qwen__Qwen3-8B", Qwen3Model), ("Qwen__Qwen3-0.6B", Qwen3Model),
    ("microsoft__Phi-3.5-mini-instruct", Phi3Model), ("google__gemma-2-9b", GemmaModel),
    ("google__gemma-3-1b-it", GemmaModel), ("mistralai__Mixtral-8x7B-v0.1", MoEModel),
    ("Qwen__Qwen3-30B-A3B", MoEModel), ("openai__gpt-oss-20b", GptOssModel),
    ("deepseek-ai__DeepSeek-V2-Lite", DeepseekModel)])
def test_catalogue_configs_run_in_their_family(name, cls):
    """Real config.json files of the types the forward passes reproduce (checked against
    transformers in test_llama.py and test_family_oracle.py)."""
    assert model_class(load_spec(config_path(name))) is cls


@pytest.mark.parametrize("name,what", [
    ("openai-community__gpt2", "learned-position"), ("deepseek-ai__DeepSeek-V3", "latent"),
    ("togethercomputer__RedPajama-INCITE-Chat-3B-v1", "")])
def test_other_families_are_refused_with_their_model_type(name, what):
    spec = load_spec(config_path(name))
    with pytest.raises(UnsupportedModelError,
                       match=rf"model_type '{spec.model_type}'.*{what}.*cannot run in the "
                             r"engine yet \(it runs llama, mistral, qwen2, qwen3, phi3, "
                             r"gemma2, gemma3_text, mixtral, qwen3_moe, gpt_oss, deepseek_v2\)"):
        model_class(spec)


@pytest.mark.parametrize("name,change,field", [
    ("meta-llama__Llama-3.1-8B", {"qk_norm": True}, "qk_norm=True"),
    ("meta-llama__Llama-3.1-8B", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("Qwen__Qwen3-8B", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("Qwen__Qwen3-8B", {"num_experts": 8}, "num_experts=8"),
    ("google__gemma-3-1b-it", {"o_bias": True}, "o_bias=True"),
    ("microsoft__Phi-3.5-mini-instruct", {"final_logit_softcapping": 30.0},
     "final_logit_softcapping=30.0"),
    ("meta-llama__Llama-3.1-8B", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling=.*yarn")])
def test_a_value_the_family_lacks_is_refused_by_name(name, change, field):
    spec = load_spec(config_path(name)).with_fields(**change)
    with pytest.raises(UnsupportedModelError, match=f"cannot run {field}.* yet"):
        model_class(spec)


def test_a_family_class_refuses_another_familys_spec():
    spec = load_spec(config_path("google__gemma-3-1b-it"))
    with pytest.raises(UnsupportedModelError, match="runs in the gemma family, not LlamaModel"):
        LlamaModel(spec, {}, None)


def test_every_family_is_in_the_table():
    assert set(FAMILIES.values()) == {LlamaModel, Qwen3Model, Phi3Model, GemmaModel,
                                      MoEModel, GptOssModel, DeepseekModel}
