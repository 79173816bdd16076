"""Engine fixtures: engines over the tiny models (tests/conftest.py) and the bundled one."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", params=["reference", "paged-native"])
def attention_backend(request):
    """Each attention backend in turn: the engine suite runs with every one of them."""
    return request.param


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_llama, attention_backend):
    """Build an LLMEngine over the tiny model (token-id prompts) with engine options, using
    each attention backend in turn (``attention=`` overrides it)."""
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_weights

    folder, _ = tiny_llama
    spec, weights = load_weights(folder, torch.float32)

    def build(**options) -> LLMEngine:
        options.setdefault("attention", attention_backend)
        options.setdefault("dtype", "fp32")  # the suite compares tokens and logits exactly
        return LLMEngine(EngineConfig(model=str(folder), **options), spec=spec, weights=weights)

    return build


@pytest.fixture(scope="session")
def bundled_llm():
    """Our LLM on the bundled model, fp32."""
    from kvledger import LLM

    return LLM("default", dtype="fp32")


@pytest.fixture(scope="session")
def sharp_llama(tmp_path_factory):
    """(folder, hf_model): the tiny shape with q and k weights x 4 (attention logits x 16),
    so that heads attend to different tokens (the random model's near-uniform attention makes
    every head's heavy hitters the oldest tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=160,
                      num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-5,
                      bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
    folder = tmp_path_factory.mktemp("sharp-llama")
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


@pytest.fixture(scope="session")
def sharp_engine_factory(sharp_llama, attention_backend):
    """Build an LLMEngine (fp32) over ``sharp_llama`` with engine options, per backend."""
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_weights

    folder, _ = sharp_llama
    spec, weights = load_weights(folder, torch.float32)

    def build(**options):
        return LLMEngine(EngineConfig(model=str(folder), dtype="fp32", attention=attention_backend,
                                      **options), spec=spec, weights=weights)
    return build
