"""The family registry: each model_type runs in its family's forward, others are refused by
name, and a spec with a field value its family does not compute is refused naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvledger.data import config_path
from kvledger.errors import UnsupportedModelError
from kvledger.model.families import ENGINE_MODEL_TYPES, FAMILIES, load_spec, model_class
from kvledger.model.families.gemma import FAMILY as GEMMA
from kvledger.model.layers.decoder import Decoder

GEMMA_DECODER = GEMMA.model()


@pytest.mark.parametrize("name,cls", [
    ("meta-llama__Llama-3.1-8B", Decoder), ("mistralai__Mistral-7B-v0.1", Decoder),
    ("Qwen__Qwen2.5-7B", Decoder), ("HuggingFaceTB__SmolLM2-135M", Decoder),
    ("Qwen__Qwen3-8B", Decoder), ("Qwen__Qwen3-0.6B", Decoder),
    ("microsoft__Phi-3.5-mini-instruct", Decoder), ("google__gemma-2-9b", GEMMA_DECODER),
    ("google__gemma-3-1b-it", GEMMA_DECODER), ("mistralai__Mixtral-8x7B-v0.1", Decoder),
    ("Qwen__Qwen3-30B-A3B", Decoder), ("openai__gpt-oss-20b", Decoder),
    ("deepseek-ai__DeepSeek-V2-Lite", Decoder)])
def test_catalogue_configs_run_in_their_family(name, cls):
    """Real config.json files of the types the forward passes reproduce (checked against
    transformers in test_llama.py and test_family_oracle.py)."""
    assert model_class(load_spec(config_path(name))) is cls
RUN_BEFORE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral",
              "qwen3_moe", "gpt_oss", "deepseek_v2")
"""The types the engine ran before the families moved into their modules (issue 53)."""


@pytest.mark.parametrize("name,what", [
    ("openai-community__gpt2", "learned-position"), ("deepseek-ai__DeepSeek-V3", "latent"),
    ("togethercomputer__RedPajama-INCITE-Chat-3B-v1", "")])
def test_other_families_are_refused_with_their_model_type(name, what):
    spec = load_spec(config_path(name))
    assert ENGINE_MODEL_TYPES[:len(RUN_BEFORE)] == RUN_BEFORE
    runs = re.escape(", ".join(ENGINE_MODEL_TYPES))
    with pytest.raises(UnsupportedModelError,
                       match=rf"model_type '{spec.model_type}'.*{what}.*cannot run in the "
                             rf"engine yet \(it runs {runs}\)"):
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


def test_a_family_forward_is_not_another_familys():
    """Gemma's (1 + w) norms and scaled embedding are its own decoder's, never the plain one's."""
    gemma = load_spec(config_path("google__gemma-3-1b-it"))
    llama = load_spec(config_path("meta-llama__Llama-3.1-8B"))
    assert model_class(gemma) is not model_class(llama)
    assert (model_class(gemma).NORM_OFFSET, model_class(llama).NORM_OFFSET) == (1.0, 0.0)


def test_every_family_module_is_in_the_registry_once():
    """Each module of ``kvledger.model.families`` declares one family, listed in the registry;
    every family the engine runs builds a decoder of the shared layers."""
    import pkgutil

    import kvledger.model.families as package

    modules = {m.name for m in pkgutil.iter_modules(package.__path__)}
    assert sorted(f.name for f in FAMILIES.families) == sorted(modules)
    runs = {f.name: f.model() for f in FAMILIES.families if f.runs_in_engine}
    assert {"llama", "qwen3", "phi3", "gemma", "moe", "gpt_oss", "deepseek"} <= set(runs)
    assert {Decoder, GEMMA_DECODER} <= set(runs.values())
    assert all(issubclass(cls, Decoder) for cls in runs.values())
    plan_only = {f.name for f in FAMILIES.families if not f.runs_in_engine}
    assert {"deepseek_v3", "qwen2_moe", "qwen3_next", "gpt2", "gpt_neox"} <= plan_only


def test_the_plain_decoder_factory_survives_its_modules_import_first():
    """Old code (485cae7): the factory was named like the module ``layers/decoder.py``, so
    importing that module first (the tensor-parallel runner does) put the module where the
    families looked for the factory: "'module' object is not callable" at engine start."""
    import subprocess
    import sys

    code = ("import kvledger.model.layers.decoder\n"
            "from kvledger.model.families import FAMILIES\n"
            "print(FAMILIES.of_type('llama').model().__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "Decoder"
