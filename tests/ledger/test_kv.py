"""KV bytes per token / block / sequence against the seed's worked numbers and hand arithmetic.

Every expected value is written as the arithmetic that produces it from the model's config
(layers x 2 (K and V) x kv_heads x head_dim x bytes), or quoted from the seed / the issue.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvledger.data import config_names
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import (
    fixed_state_bytes,
    kv_bytes_per_block,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_heads_per_rank,
    residual_bytes,
    vector_bytes,
)
from kvledger.ledger.kv_format import KV_FORMATS, KVFormatSpec

BF16, FP16 = KVFormatSpec("bf16"), KVFormatSpec("fp16")

KiB, MiB, GiB = 2**10, 2**20, 2**30

# name -> KV bytes per token in bf16, every per-token layer counted, no window cap
HAND_KV_PER_TOKEN = {
    "HuggingFaceTB__SmolLM2-135M": 30 * 2 * 3 * 64 * 2,  # 30 layers, 3 KV heads, 576/9 = 64
    "HuggingFaceTB__SmolLM2-360M": 32 * 2 * 5 * 64 * 2,  # 960/15 = 64
    "Qwen__Qwen2.5-7B": 28 * 2 * 4 * 128 * 2,  # 3584/28 = 128
    "Qwen__Qwen3-30B-A3B": 48 * 2 * 4 * 128 * 2,  # explicit head_dim 128 (hidden 2048 / 32 = 64!)
    "Qwen__Qwen3-8B": 36 * 2 * 8 * 128 * 2,
    "Qwen__Qwen3-0.6B": 28 * 2 * 8 * 128 * 2,  # head_dim 128 (hidden 1024 / 16 = 64)
    "microsoft__Phi-3.5-mini-instruct": 32 * 2 * 32 * 96 * 2,  # MHA, 3072 / 32 = 96
    "microsoft__Phi-4-mini-instruct": 32 * 2 * 8 * 128 * 2,  # 3072 / 24 = 128, 8 KV heads
    "allenai__Olmo-3-7B-Think": 32 * 2 * 32 * 128 * 2,  # MHA, 4096 / 32 = 128 (windows: none)
    "Qwen__Qwen3-Next-80B-A3B-Thinking": (48 // 4) * 2 * 2 * 256 * 2,  # 12 full-attention layers
    "Qwen__Qwen3.5-0.8B": 6 * 2 * 2 * 256 * 2,  # 6 full layers of 24, 2 KV heads of 256
    "Qwen__Qwen3.5-35B-A3B": 10 * 2 * 2 * 256 * 2,  # 10 full layers of 40
    "LiquidAI__LFM2-1.2B": 6 * 2 * 8 * 64 * 2,  # 6 attention layers of 16, 2048 / 32 = 64
    "Qwen__Qwen3.5-2B": 6 * 2 * 2 * 256 * 2,  # 6 full layers of 24, 2 KV heads of 256
    "Qwen__Qwen3.5-4B": 8 * 2 * 4 * 256 * 2,  # 8 full layers of 32, 4 KV heads of 256
    "Qwen__Qwen3.5-9B": 8 * 2 * 4 * 256 * 2,  # 8 full layers of 32, 4 KV heads of 256
    "LiquidAI__LFM2-350M": 6 * 2 * 8 * 64 * 2,  # 6 attention layers of 16, 1024 / 16 = 64
    "LiquidAI__LFM2-2.6B": 8 * 2 * 8 * 64 * 2,  # 8 attention layers of 30, 2048 / 32 = 64
    "ibm-granite__granite-4.0-h-micro": 4 * 2 * 8 * 64 * 2,  # 4 attention layers of 40
    "ibm-granite__granite-4.0-h-tiny": 4 * 2 * 4 * 128 * 2,  # 4 attention layers, 1536 / 12
    "deepseek-ai__DeepSeek-V2-Lite": 27 * (512 + 64) * 2,  # MLA latent + rope key, no factor 2
    "deepseek-ai__DeepSeek-V3": 61 * (512 + 64) * 2,
    "google__gemma-2-9b": 42 * 2 * 8 * 256 * 2,
    "google__gemma-3-1b-it": 26 * 2 * 1 * 256 * 2,
    "meta-llama__Llama-2-13b-hf": 40 * 2 * 40 * 128 * 2,
    "meta-llama__Llama-2-7b-hf": 32 * 2 * 32 * 128 * 2,
    "meta-llama__Llama-3.1-70B": 80 * 2 * 8 * 128 * 2,
    "meta-llama__Llama-3.1-8B": 32 * 2 * 8 * 128 * 2,
    "meta-llama__Llama-3.2-1B": 16 * 2 * 8 * 64 * 2,  # explicit head_dim 64
    "mistralai__Mistral-7B-v0.1": 32 * 2 * 8 * 128 * 2,
    "mistralai__Mixtral-8x7B-v0.1": 32 * 2 * 8 * 128 * 2,
    "openai-community__gpt2": 12 * 2 * 12 * 64 * 2,  # n_layer 12, n_head 12, 768/12
    "openai__gpt-oss-20b": 24 * 2 * 8 * 64 * 2,
    "togethercomputer__RedPajama-INCITE-Chat-3B-v1": 32 * 2 * 32 * 80 * 2,  # 2560/32 = 80
}


def test_every_bundled_config_has_a_hand_checked_figure():
    """A config added to ``kvledger/data/configs`` needs its hand figure here too."""
    assert set(config_names()) == set(HAND_KV_PER_TOKEN)


@pytest.mark.parametrize("name", sorted(HAND_KV_PER_TOKEN))
def test_kv_per_token_of_every_real_config(real_spec, name):
    assert kv_bytes_per_token(real_spec(name), BF16, 1, 16) == HAND_KV_PER_TOKEN[name]


def test_kv_formats_names():
    assert KV_FORMATS == ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int3", "int2")


def test_seed_7b_mha_and_gqa8(real_spec):
    """Seed §2.2 / §3.1 / §5.2: Llama-2-7B (32 layers, 32 heads, head_dim 128, fp16)."""
    mha = real_spec("meta-llama__Llama-2-7b-hf")
    assert kv_bytes_per_token(mha, FP16, 1, 16) == 512 * KiB
    assert kv_bytes_per_sequence(mha, FP16, 1, 16, 8192) == 4 * GiB
    assert kv_bytes_per_sequence(mha, FP16, 1, 16, 32768) == 16 * GiB
    assert kv_bytes_per_sequence(mha, FP16, 1, 16, 131072) == 64 * GiB
    gqa = dataclasses.replace(mha, num_kv_heads=8)
    assert kv_bytes_per_token(gqa, FP16, 1, 16) == 128 * KiB
    assert kv_bytes_per_sequence(gqa, FP16, 1, 16, 8192) == 1 * GiB
    assert kv_bytes_per_sequence(gqa, FP16, 1, 16, 32768) == 4 * GiB


def test_seed_chat_growth_by_turn(real_spec):
    """Seed §2.3: 1K tokens per turn; after turns 1/2/4/8: 512 MiB / 1 / 2 / 4 GiB."""
    mha = real_spec("meta-llama__Llama-2-7b-hf")
    got = [kv_bytes_per_sequence(mha, FP16, 1, 16, t * 1024) for t in (1, 2, 4, 8)]
    assert got == [512 * MiB, 1 * GiB, 2 * GiB, 4 * GiB]


def test_gpt_oss_20b_batch_32_full_vs_window_aware(real_spec):
    """Issue: 8192 tokens x batch 32, bf16: 12.00 GiB full reservation, 6.09 GiB window-aware."""
    spec = real_spec("openai__gpt-oss-20b")
    full = 32 * kv_bytes_per_sequence(spec, BF16, 1, 16, 8192, window_aware=False)
    aware = 32 * kv_bytes_per_sequence(spec, BF16, 1, 16, 8192, window_aware=True)
    assert full == 32 * 8192 * 24 * 2 * 8 * 64 * 2 == 12 * GiB
    # 12 full layers keep 8192 tokens, 12 sliding layers keep 128
    assert aware == 32 * (12 * 8192 + 12 * 128) * 2 * 8 * 64 * 2
    assert round(aware / GiB, 2) == 6.09


def test_gemma2_9b_window_saves_a_quarter(real_spec):
    """Issue: Gemma-2-9B at 8192: 2.625 GiB full vs ~1.97 GiB window-aware (25 % saving)."""
    spec = real_spec("google__gemma-2-9b")
    full = kv_bytes_per_sequence(spec, BF16, 1, 16, 8192, window_aware=False)
    aware = kv_bytes_per_sequence(spec, BF16, 1, 16, 8192, window_aware=True)
    assert full / GiB == 2.625
    assert aware == (21 * 8192 + 21 * 4096) * 2 * 8 * 256 * 2
    assert round(aware / GiB, 2) == 1.97
    assert 1 - aware / full == 0.25


def test_deepseek_v3_mla_latent(real_spec):
    """Issue: DeepSeek-V3 stores 70,272 B/token (not K+V heads, not GQA)."""
    spec = real_spec("deepseek-ai__DeepSeek-V3")
    assert kv_bytes_per_token(spec, BF16, 1, 16) == 70_272
    assert kv_bytes_per_token(spec, KVFormatSpec("fp8"), 1, 16) == 61 * 576


def test_window_aware_per_token_is_the_growth_past_every_window(real_spec):
    gemma3 = real_spec("google__gemma-3-1b-it")  # 22 sliding (512) + 4 global layers
    assert kv_bytes_per_token(gemma3, BF16, 1, 16, window_aware=True) == 4 * 2 * 1 * 256 * 2
    grow = (kv_bytes_per_sequence(gemma3, BF16, 1, 16, 10_001)
            - kv_bytes_per_sequence(gemma3, BF16, 1, 16, 10_000))
    assert grow == 4 * 2 * 1 * 256 * 2


def test_mistral_uniform_window(real_spec):
    spec = real_spec("mistralai__Mistral-7B-v0.1")
    assert kv_bytes_per_sequence(spec, BF16, 1, 16, 32768) == 4096 * 32 * 2 * 8 * 128 * 2
    assert kv_bytes_per_sequence(spec, BF16, 1, 16, 32768,
                                 window_aware=False) == 32768 * 32 * 2 * 8 * 128 * 2


def test_qwen3_next_fixed_state(real_spec):
    """36 Gated DeltaNet layers: 32 value heads x 128 x 128 recurrent state plus a 3-step conv
    tail over 2 x 16 x 128 (q, k) + 32 x 128 (v) channels, kept in bf16."""
    spec = real_spec("Qwen__Qwen3-Next-80B-A3B-Thinking")
    per_layer = 32 * 128 * 128 + (4 - 1) * (2 * 16 * 128 + 32 * 128)
    assert fixed_state_bytes(spec) == 36 * per_layer * 2
    assert kv_bytes_per_sequence(spec, BF16, 1, 16, 1000) == 1000 * 12 * 2 * 2 * 256 * 2


def test_block_bytes_and_rounding(real_spec):
    spec = real_spec("meta-llama__Llama-3.1-8B")
    assert kv_bytes_per_block(spec, BF16, 1, 16) == 16 * 32 * 2 * 8 * 128 * 2 == 2 * MiB
    assert kv_bytes_per_block(spec, KVFormatSpec("fp32"), 1, 16) == 16 * 32 * 2 * 8 * 128 * 4
    assert kv_bytes_per_sequence(spec, BF16, 1, 16, 100, paged=True) == 112 * 32 * 2 * 8 * 128 * 2
    with pytest.raises(InvalidParameterError):
        kv_bytes_per_block(spec, BF16, 1, 0)


def test_quantized_formats_follow_the_engine_block_layout(real_spec):
    """Per block of 16 tokens and KV head (head_dim 128), counted by hand from the layout in
    engine/kv/codecs.py: codes for K and V; fp8 one fp32 scale each; int8/int4 an fp16 scale +
    fp16 zero point per group: values per token per 32 channels, keys per channel over the
    block (or per token); outlier key channels 2 bytes per token each."""
    spec = real_spec("meta-llama__Llama-3.1-8B")
    heads = 32 * 8  # layers x kv heads

    def block(fmt, **kw):
        return kv_bytes_per_block(spec, KVFormatSpec(fmt, **kw), 1, 16)

    values_meta = 16 * (128 // 32) * 4
    assert block("fp8") == heads * (2 * 16 * 128 + 4 + 4)
    assert block("int8") == heads * (2 * 16 * 128 + values_meta + 128 * 4)
    assert block("int4") == heads * (2 * 16 * 64 + values_meta + 128 * 4)
    assert block("int4", key_quant="per-token") == heads * (2 * 16 * 64 + 2 * values_meta)
    assert block("int8", group_size=64) == heads * (2 * 16 * 128 + 16 * 2 * 4 + 128 * 4)
    # 2 % of 128 channels -> ceil(2.56) = 3 outliers; or 4 named
    assert block("int4", outlier_frac=0.02) == block("int4") + heads * 16 * 3 * 2
    assert block("int4", outlier_channels=4) == block("int4") + heads * 16 * 4 * 2
    # per token: the block's bytes / 16, rounded up per layer (fp8: 4104 / 16 = 256.5 -> 257)
    assert kv_bytes_per_token(spec, KVFormatSpec("fp8"), 1, 16) == 32 * -(-8 * 4104 // 16)
    int4 = KVFormatSpec("int4")
    assert kv_bytes_per_sequence(spec, int4, 1, 16, 100, paged=True) == 7 * block("int4")
    # a quantized format's residual in the compute format: by default a window of 128 tokens
    # (8 blocks) and 32 intact tokens (2 blocks) twice; one block with R = G, no intact tokens
    assert residual_bytes(spec, int4, 1, 16, "bf16") == (8 + 2 * 2) * block("bf16")
    assert residual_bytes(spec, KVFormatSpec("int4", residual_tokens=16, intact_tokens=0), 1, 16,
                          "bf16") == block("bf16")
    assert residual_bytes(spec, KVFormatSpec("int4", residual_tokens=64, intact_tokens=0), 1, 16,
                          "fp32") == 4 * block("fp32")
    assert residual_bytes(spec, BF16, 1, 16, "bf16") == 0
    for bad in (24, 0):
        with pytest.raises(InvalidParameterError, match="multiple of --block-size 16"):
            residual_bytes(spec, KVFormatSpec("int4", residual_tokens=bad), 1, 16, "bf16")
    for bad in ({"group_size": 48}, {"outlier_channels": 128}, {"key_quant": "per-row"}):
        with pytest.raises(InvalidParameterError):
            block("int4", **bad)
    with pytest.raises(InvalidParameterError):
        block("bf16", outlier_channels=2)


def test_mla_latent_is_priced_per_vector():
    """vector_bytes: the MLA latent's per-vector price (int8: 1 B/elem + fp16 scale and zero
    point per group; default group = the whole vector)."""
    assert vector_bytes(576, KVFormatSpec("int8")) == 576 + 4
    assert vector_bytes(576, KVFormatSpec("int4", group_size=64)) == 288 + 9 * 4
    assert vector_bytes(128, KVFormatSpec("fp32")) == 512


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "int5"},
        {"name": "int4", "group_size": 0},
        {"name": "int4", "outlier_frac": 1.0},
        {"name": "bf16", "outlier_frac": 0.1},
    ],
)
def test_bad_format_arguments(kwargs):
    with pytest.raises(InvalidParameterError):
        vector_bytes(128, KVFormatSpec(**kwargs))


def test_tensor_parallel_heads(real_spec):
    spec = real_spec("meta-llama__Llama-3.1-8B")  # 32 query heads, 8 KV heads
    assert kv_heads_per_rank(spec, 2) == 4
    assert kv_heads_per_rank(spec, 16) == 1  # 8 KV heads over 16 ranks: each rank keeps a copy
    assert kv_bytes_per_token(spec, BF16, 16, 16) == 32 * 2 * 1 * 128 * 2
    assert kv_bytes_per_token(spec, BF16, 2, 16) == 32 * 2 * 4 * 128 * 2
    for bad in (3, 64, 0):
        with pytest.raises(InvalidParameterError):
            kv_heads_per_rank(spec, bad)
