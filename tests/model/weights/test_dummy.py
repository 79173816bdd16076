"""``--load-format dummy``: weights at the exact shapes of a model from its config alone.

Oracle for the shapes: transformers' own model of the same catalogue config, built on the
meta device (no memory), whose state dict names every tensor the checkpoint would hold.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvledger.data import config_path
from kvledger.engine.config import EngineConfig
from kvledger.engine.engine import LLMEngine
from kvledger.errors import KVBudgetError, ModelNotFoundError, UnsupportedModelError
from kvledger.model.families import family_of
from kvledger.model.weights import dummy as dummy_module
from kvledger.model.weights.dummy import BOUND, dummy_spec
from kvledger.model.weights.loader import load_weights
from kvledger.model.weights.names import tensor_shapes, to_common_names


@pytest.mark.parametrize("model_id", ["Qwen/Qwen3-0.6B", "microsoft/Phi-4-mini-instruct",
                                      "google/gemma-2-9b", "google/gemma-3-1b-it",
                                      "meta-llama/Llama-3.2-1B"])
def test_shapes_are_the_transformers_models(model_id):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dummy_spec(model_id)
    raw = json.loads(config_path(model_id.replace("/", "__")).read_text())
    cfg = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    want = {name: t for name, t in hf.state_dict().items() if "rotary_emb" not in name}
    if spec.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    to_common_names(want, spec, family_of(spec))
    shapes = tensor_shapes(spec, family_of(spec))
    assert shapes == {name: tuple(t.shape) for name, t in want.items()}


def test_values_are_seeded_bounded_and_norms_identity(tmp_path):
    gemma = _tiny_config(tmp_path / "g", "google__gemma-3-1b-it")
    weights = load_weights(gemma, torch.bfloat16, "dummy")[1]
    again = load_weights(gemma, torch.bfloat16, "dummy")[1]
    norms = [name for name in weights if name.endswith("norm.weight")]
    assert len(norms) == 2 * 6 + 1  # four sandwich norms and q / k norms per layer, final
    assert all(float(weights[n].abs().max()) == 0.0 for n in norms)  # Gemma's (1 + w): w = 0
    matrix = weights["model.layers.1.mlp.down_proj.weight"]
    assert matrix.dtype == torch.bfloat16 and float(matrix.abs().max()) <= BOUND
    assert float(matrix.float().std()) > BOUND / 3  # uniform in [-B, B]: std B / sqrt(3)
    assert torch.equal(matrix, again["model.layers.1.mlp.down_proj.weight"])
    qwen = load_weights(_tiny_config(tmp_path / "q"), torch.float32, "dummy")[1]
    assert float(qwen["model.layers.0.self_attn.q_norm.weight"].min()) == 1.0


def test_unknown_ids_and_plan_only_families_are_refused_before_any_weight():
    with pytest.raises(ModelNotFoundError, match="catalogue"):
        load_weights("no-such/model", torch.float32, "dummy")
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*it runs llama"):
        load_weights("openai-community/gpt2", torch.float32, "dummy")


def _tiny_config(folder, name="Qwen__Qwen3-0.6B"):
    """A catalogue config shrunk to 2 layers of 64, in ``folder`` (no weights, no tokenizer)."""
    raw = json.loads(config_path(name).read_text())
    raw.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=49152)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_engine_runs_a_config_alone_with_the_bundled_tokenizer(tmp_path):
    engine = LLMEngine(EngineConfig(model=str(_tiny_config(tmp_path / "m")), dtype="fp32",
                                    load_format="dummy", num_blocks=8))
    assert engine.tokenizer_note and "bundled" in engine.tokenizer_note
    assert engine.model_name == "m"
    engine.add_request("a", "Hello there", None)
    while engine.has_unfinished_requests():
        engine.step()


def test_refused_before_the_weights_when_they_and_the_pool_exceed_memory(monkeypatch):
    """Qwen3-0.6B: 0.6 G parameters in bf16 (1.2 GB) and a 1 GiB pool against 1 GiB free; the
    weights are never made."""
    from kvledger.device import measure

    monkeypatch.setattr(measure, "available_memory_bytes", lambda: 1 << 30)
    monkeypatch.setattr(dummy_module, "dummy_weights", lambda *a: pytest.fail("allocated"))
    with pytest.raises(KVBudgetError, match=r"Qwen3-0.6B does not fit: its weights take 1\.\d\d "
                                            r"GiB in bf16 and its KV pool 1\.00 GiB"):
        LLMEngine(EngineConfig(model="Qwen/Qwen3-0.6B", load_format="dummy"))
