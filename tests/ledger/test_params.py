"""Parameter counts against model cards, the bundled GGUF, and transformers as an oracle."""

from __future__ import annotations

import json
import math

import pytest

from kvledger.data import config_names, configs_dir
from kvledger.errors import InvalidParameterError, ModelNotFoundError
from kvledger.ledger.params import (
    count_params,
    params_read_per_step,
    spec_weight_bytes,
    weight_bytes,
)


def within(value: float, card: float, tol: float = 0.01) -> bool:
    return abs(value - card) / card <= tol


# model card figures (billions): total, active (None = dense)
CARDS = {
    "meta-llama__Llama-2-7b-hf": (6.74, None),  # Llama 2 paper, Table 1 / HF card
    "meta-llama__Llama-3.1-8B": (8.03, None),  # HF card "8.03B params"
    "mistralai__Mixtral-8x7B-v0.1": (46.7, 12.9),  # Mistral AI blog: 46.7B total, 12.9B per token
    "Qwen__Qwen3-30B-A3B": (30.5, 3.3),  # Qwen3 card: 30.5B, 3.3B activated
    "deepseek-ai__DeepSeek-V3": (671, 37),  # DeepSeek-V3 report: 671B, 37B activated
    "google__gemma-2-9b": (9.24, None),  # HF card "9.24B params"
    "meta-llama__Llama-3.2-1B": (1.24, None),  # HF card "1.24B params" (tied embeddings)
    "openai__gpt-oss-20b": (20.9, 3.6),  # OpenAI gpt-oss model card: 20.91B total, 3.61B active
}


def test_a_missing_config_is_an_error_not_a_skip(real_spec):
    """The configs ship in the package: a name that is not there fails the test that asks."""
    with pytest.raises(ModelNotFoundError, match="no bundled config 'nobody__nothing'"):
        real_spec("nobody__nothing")


@pytest.mark.parametrize("name", sorted(CARDS))
def test_total_within_one_percent_of_the_card(real_spec, name):
    assert within(count_params(real_spec(name)).total / 1e9, CARDS[name][0])


def test_dense_models_have_active_equal_total(real_spec):
    p = count_params(real_spec("meta-llama__Llama-3.1-8B"))
    assert p.active == p.total


def test_mixtral_active(real_spec):
    assert within(count_params(real_spec("mistralai__Mixtral-8x7B-v0.1")).active / 1e9, 12.9)


def test_qwen3_30b_a3b_active(real_spec):
    """The card's "3.3B activated" is given to two significant figures; the exact count is
    48 x (attention 18.87 M + 8 of 128 experts x 4.72 M + router 0.26 M) + 2 x 311 M embeddings
    = 3.353 B, which the card truncates to 3.3 (1.6 % away, so 1 % cannot be asked of it)."""
    active = count_params(real_spec("Qwen__Qwen3-30B-A3B")).active
    attention = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128
    moe = 8 * 3 * 2048 * 768 + 128 * 2048
    norms = 48 * 2 * 2048 + 2048
    assert active == 48 * (attention + moe) + 2 * 151936 * 2048 + norms
    assert math.floor(active / 1e8) / 10 == 3.3


def test_deepseek_v3_active(real_spec):
    """DeepSeek counts 37B activated without the input-embedding lookup (as OpenAI does for
    gpt-oss, whose 3.61 B matches that convention to 0.1 %). The exact sum is 36.63 B without the
    embedding / 37.55 B with it; the card's "37B" is two significant figures. Independent recounts
    (deepseek-ai/DeepSeek-V3 issue #231) land on the same sums."""
    p = count_params(real_spec("deepseek-ai__DeepSeek-V3"))
    matmul_active = p.active - p.embedding
    assert round(matmul_active / 1e9) == 37
    assert within(matmul_active / 1e9, 37, tol=0.011)
    gpt_oss = count_params(real_spec("openai__gpt-oss-20b"))
    assert within((gpt_oss.active - gpt_oss.embedding) / 1e9, 3.61, tol=0.002)


def test_gpt2_exact_and_tied(real_spec):
    """GPT-2 small: the well-known 124,439,808 parameters (learned positions, biases, tied)."""
    p = count_params(real_spec("openai-community__gpt2"))
    h, v, n = 768, 50257, 12
    layer = (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h) + 2 * 2 * h
    assert p.total == v * h + 1024 * h + n * layer + 2 * h == 124_439_808
    assert p.lm_head == 0


@pytest.mark.slow
def test_bundled_gguf_counts_its_tensor_elements():
    from kvledger.model.families import load_spec

    spec = load_spec("default")
    assert count_params(spec).total == 134_515_008
    assert spec_weight_bytes(spec) == spec.gguf.tensor_bytes


def test_smollm2_config_matches_the_gguf_element_count(real_spec):
    """The same model from its config.json (tied embeddings counted once): 134,515,008."""
    assert count_params(real_spec("HuggingFaceTB__SmolLM2-135M")).total == 134_515_008


def test_weight_bytes_per_dtype():
    n = 1_000_000
    assert weight_bytes(n, "fp32") == 4 * n
    assert weight_bytes(n, "bf16") == 2 * n
    assert weight_bytes(n, "fp8") == n
    assert weight_bytes(n, "int8") == n + math.ceil(n / 128) * 2
    assert weight_bytes(n, "int4") == n // 2 + math.ceil(n / 128) * 4
    with pytest.raises(InvalidParameterError):
        weight_bytes(n, "int3")


def test_moe_weights_read_per_decode_step(real_spec):
    spec = real_spec("mistralai__Mixtral-8x7B-v0.1")
    p = count_params(spec)
    assert params_read_per_step(spec, 1) == p.active
    assert params_read_per_step(spec, 1000) == pytest.approx(p.total, rel=1e-9)
    dense = real_spec("meta-llama__Llama-3.1-8B")
    assert params_read_per_step(dense, 64) == count_params(dense).total


@pytest.mark.slow
def test_totals_match_transformers_on_the_meta_device():
    """transformers builds every vendored architecture on the meta device (no memory); its
    parameter count must equal ours. DeepSeek-V3's router score-correction bias is a buffer
    there but a tensor in the checkpoint; V2-Lite's upstream config sets q_lora_rank null (the
    vendored copy dropped the key, whose transformers default is 1536)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvledger.model.families import spec_from_hf_config

    paths = sorted(configs_dir().glob("*.json"))
    assert {p.stem for p in paths} == set(config_names()) >= set(CARDS)  # never an empty loop
    for path in paths:
        raw = json.loads(path.read_text())
        raw.pop("auto_map", None)
        raw.pop("quantization_config", None)
        if raw["model_type"] == "deepseek_v2":
            raw.setdefault("q_lora_rank", None)
        config = transformers.AutoConfig.for_model(**raw)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        expected = sum(p.numel() for p in model.parameters())
        expected += sum(b.numel() for n, b in model.named_buffers() if "e_score_correction" in n)
        assert count_params(spec_from_hf_config(path)).total == expected, path.name
