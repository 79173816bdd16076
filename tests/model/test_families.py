"""The family table: each model_type runs in its family's class, others are refused by name."""

from __future__ import annotations

import pytest

from kvledger.data import config_path
from kvledger.errors import UnsupportedModelError
from kvledger.model.families import model_class
from kvledger.model.llama import LlamaModel
from kvledger.spec import load_spec


@pytest.mark.parametrize("name", ["meta-llama__Llama-3.1-8B", "mistralai__Mistral-7B-v0.1",
                                  "Qwen__Qwen2.5-7B", "HuggingFaceTB__SmolLM2-135M"])
def test_llama_family_configs_run_in_the_llama_class(name):
    """Real config.json files of the three types the Llama forward pass reproduces (checked
    against transformers in test_llama.py)."""
    assert model_class(load_spec(config_path(name))) is LlamaModel


@pytest.mark.parametrize("name", ["google__gemma-2-9b", "Qwen__Qwen3-8B", "openai-community__gpt2"])
def test_other_families_are_refused_with_their_model_type(name):
    spec = load_spec(config_path(name))
    with pytest.raises(UnsupportedModelError,
                       match=rf"model_type '{spec.model_type}' cannot run in the engine yet"):
        model_class(spec)
