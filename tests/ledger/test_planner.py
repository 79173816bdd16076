"""The plan as a whole: the seed's template end to end, the JSON contract, warnings, errors.

Expected values are the seed's worked figures, model cards and datasheets, or arithmetic written
out here from a config's numbers; none is computed with the ledger's own functions.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvledger.errors import InvalidParameterError
from kvledger.ledger.hardware import Device, get_device
from kvledger.ledger.planner import PlanOptions, plan

GiB = 2**30
CONTRACT = {"params_total", "params_active", "weights_bytes", "kv_bytes_per_token", "contexts"}
CONTEXT_CONTRACT = {
    "context",
    "kv_bytes_per_sequence",
    "fixed_state_bytes",
    "max_concurrency",
    "ttft_s",
    "tpot_floor_s",
}
SEED_CARD = Device("seed-80GB", 80, 2000, 300, "seed §3")


def test_seed_template_llama2_7b(real_spec):
    """Seed §5.2 on the real Llama-2-7B config, fp16 weights (6.74 B x 2 B, not the rounded 14 GB),
    10 GiB reserve, the whole card usable."""
    spec = real_spec("meta-llama__Llama-2-7b-hf")
    opts = PlanOptions(
        contexts=(8192, 32768), kv_format="fp16", weights_dtype="fp16", reserve_gib=10, gpu_util=1.0
    )
    p = plan(spec, SEED_CARD, opts)
    weights = 6_738_415_616 * 2
    assert p.weights_bytes == weights
    assert p.kv_bytes_per_token == 512 * 1024
    c8, c32 = p.contexts
    assert c8.kv_bytes_per_sequence == 4 * GiB and c32.kv_bytes_per_sequence == 16 * GiB
    assert c8.max_concurrency == (80 * GiB - weights - 10 * GiB) // (4 * GiB) == 14
    assert c32.max_concurrency == 3
    # TPOT floor, seed §3.2: "14 GB weights + 4 GB KV at 2 TB/s -> ~9 ms; 32K: 30 GB -> ~15 ms"
    # (here 13.48 GB of weights and 4 GiB = 4.29 GB / 16 GiB = 17.18 GB of KV)
    assert round(c8.tpot_floor_s * 1e3, 2) == 8.89
    assert round(c32.tpot_floor_s * 1e3, 1) == 15.3
    # GQA-8 also shrinks k_proj and v_proj: 32 layers x 2 x 4096 x (4096 - 1024) fewer weights
    gqa = plan(dataclasses.replace(spec, num_kv_heads=8), SEED_CARD, opts)
    gqa_weights = weights - 2 * 32 * 2 * 4096 * (4096 - 1024)
    assert gqa.weights_bytes == gqa_weights
    assert gqa.contexts[0].max_concurrency == (80 * GiB - gqa_weights - 10 * GiB) // GiB == 58


def test_json_contract(real_spec):
    p = plan(
        real_spec("openai__gpt-oss-20b"),
        get_device("H100-SXM"),
        PlanOptions(contexts=(8192,), batch=32),
    )
    out = p.to_json()
    assert CONTRACT <= set(out)
    assert CONTEXT_CONTRACT <= set(out["contexts"][0])
    row = out["contexts"][0]
    assert out["kv_bytes_per_token"] == 24 * 2 * 8 * 64 * 2  # no window cap
    assert row["kv_bytes_per_sequence"] == (12 * 8192 + 12 * 128) * 2 * 8 * 64 * 2
    assert 32 * row["kv_bytes_full_reservation"] == 12 * GiB
    assert row["kv_bytes_batch"] == 32 * row["kv_bytes_per_sequence"]


def test_no_window_savings_sizes_sliding_layers_fully(real_spec):
    spec = real_spec("google__gemma-2-9b")
    p = plan(spec, get_device("H100-SXM"), PlanOptions(contexts=(8192,), window_aware=False))
    assert p.contexts[0].kv_bytes_per_sequence == int(2.625 * GiB)


def test_fixed_state_in_the_contexts(real_spec):
    spec = real_spec("Qwen__Qwen3-Next-80B-A3B-Thinking")
    p = plan(spec, get_device("H200"), PlanOptions(contexts=(4096,), tp=2))
    state = 36 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 2
    assert p.contexts[0].fixed_state_bytes == state // 2  # split by heads over 2 ranks
    assert p.kv_bytes_per_token == 12 * 2 * 1 * 256 * 2  # 2 KV heads over 2 ranks


def test_llama31_8b_on_h100_by_hand(real_spec):
    """H100-SXM: 80 GiB (datasheet). Weights: 8,030,261,248 parameters (the card's 8.03 B;
    transformers counts the same, test_params) x 2 bytes (bf16) = 16,060,522,496 B. Pool =
    int(0.9 x 80 GiB) - weights - 2 GiB reserve = 77,309,411,328 - 16,060,522,496 -
    2,147,483,648 = 59,101,405,184 B. A block of 16 tokens: 16 x 32 layers x 2 x 8 KV heads x
    128 x 2 B = 2 MiB, so 28,181 blocks; an 8K request is 1 GiB (55 fit); with a 4K prefix
    shared, each adds 0.5 GiB: (59,101,405,184 - 0.5 GiB) // 0.5 GiB = 109."""
    spec = real_spec("meta-llama__Llama-3.1-8B")
    p = plan(spec, get_device("H100-SXM"), PlanOptions(contexts=(8192,), shared_prefix=4096))
    assert p.weights_bytes == 16_060_522_496
    assert p.pool_bytes == 59_101_405_184
    assert (p.block_bytes, p.pool_blocks) == (2 * 2**20, 28_181)
    row = p.contexts[0]
    assert (row.max_concurrency, row.shared_prefix_concurrency) == (55, 109)
    # the longest request alone: 28,181 x 16 + 1 tokens would fit, the context (131,072) is less
    assert p.max_request_tokens == 131_072


def test_longest_request_on_a_small_card(real_spec):
    """L4: 24 GiB. Pool = int(0.9 x 24 GiB) - 16,060,522,496 - 2 GiB = 4,984,817,254 B =
    2,376 blocks of 2 MiB (2,376.98); a request alone may reach 2,376 x 16 slots + 1 (the last
    sampled token stores no KV) = 38,017 tokens."""
    p = plan(real_spec("meta-llama__Llama-3.1-8B"), get_device("L4"), PlanOptions(contexts=(8192,)))
    assert (p.pool_bytes, p.pool_blocks) == (4_984_817_254, 2_376)
    assert p.max_request_tokens == 38_017


def test_formats_what_if(real_spec):
    p = plan(
        real_spec("meta-llama__Llama-3.1-8B"), get_device("H100-SXM"), PlanOptions(contexts=(8192,))
    )
    by = {f.kv_format: f for f in p.formats}
    # fp8: 1 byte per element + one fp32 scale per 16-token block, KV head and K/V
    assert by["bf16"].kv_bytes_per_sequence[0] == 8192 * 32 * 8 * 2 * 128 * 2
    assert by["fp8"].kv_bytes_per_sequence[0] == 8192 // 16 * 32 * 8 * (2 * 16 * 128 + 2 * 4)
    fp8_request = 8192 // 16 * 32 * 8 * (2 * 16 * 128 + 2 * 4)
    assert by["fp8"].max_concurrency[0] == p.pool_bytes // fp8_request
    assert by["fp8"].max_concurrency[0] >= 2 * by["bf16"].max_concurrency[0] - 1  # scales cost
    assert by["fp8"].tpot_floor_s[0] < by["bf16"].tpot_floor_s[0]


def test_moe_tpot_reads_active_experts_at_batch_1(real_spec):
    """Mixtral-8x7B at batch 1 reads its active weights only: the card's 12.9 B x 2 B (bf16) /
    2 ranks = 12.9 GB per rank, plus 1024 tokens x 32 layers x 2 x 4 KV heads per rank x 128 x
    2 B = 64 MiB of KV, over the H100-SXM's 3.35 TB/s: 3.87 ms (all 46.7 B would be 13.9 ms)."""
    spec = real_spec("mistralai__Mixtral-8x7B-v0.1")
    p = plan(spec, get_device("H100-SXM"), PlanOptions(contexts=(1024,), tp=2))
    assert p.contexts[0].tpot_floor_s == pytest.approx((12.9e9 + 64 * 2**20) / 3.35e12, rel=0.01)


def test_context_beyond_max_position_is_a_warning(real_spec):
    p = plan(real_spec("openai-community__gpt2"), get_device("L4"), PlanOptions(contexts=(2048,)))
    assert any("max_position_embeddings (1024)" in w for w in p.warnings)


def test_weights_that_do_not_fit_warn(real_spec):
    p = plan(real_spec("deepseek-ai__DeepSeek-V3"), get_device("L4"), PlanOptions(contexts=(1024,)))
    assert p.contexts[0].max_concurrency == 0
    assert any("no room for KV" in w for w in p.warnings)


@pytest.mark.parametrize(
    "opts",
    [
        PlanOptions(contexts=(0,)),
        PlanOptions(contexts=(-5,)),
        PlanOptions(tp=3),
        PlanOptions(batch=0),
        PlanOptions(contexts=(1024,), shared_prefix=1024),
        PlanOptions(kv_format="int5"),
    ],
)
def test_bad_options(real_spec, opts):
    with pytest.raises(InvalidParameterError):
        plan(real_spec("meta-llama__Llama-3.1-8B"), get_device("H100-SXM"), opts)


def test_a_context_beyond_the_pool_says_why_concurrency_is_0(real_spec):
    """Llama-3.1-8B's KV is 128 KiB per token (32 layers x 2 x 8 KV heads x 128 x 2 B); 131,072
    tokens = 16 GiB, more than the L4's 4.64 GiB pool (test above): the row shows 0 and says why."""
    p = plan(real_spec("meta-llama__Llama-3.1-8B"), get_device("L4"),
             PlanOptions(contexts=(8192, 131_072)))
    assert [r.max_concurrency for r in p.contexts][1] == 0
    assert [w for w in p.warnings if "not even one fits" in w] == [
        ("context 131072: one request's KV (16.00 GiB) is more than the KV pool (4.64 GiB), so "
        "not even one fits (concurrency 0)")]


@pytest.mark.parametrize("turn_tokens, rows, full_turn", [(1024, [1, 2, 4, 8], 8),
                                                          (3000, [1, 2], 3)])
def test_chat_growth_stops_at_the_models_context(real_spec, turn_tokens, rows, full_turn):
    """SmolLM2-135M's context is 8,192 tokens (max_position_embeddings of its config): a chat of 1,024-token turns fills
    it at turn 8 (the table's turns 16 and 32 would be past it), of 3,000-token turns at turn 3."""
    spec = real_spec("HuggingFaceTB__SmolLM2-135M")
    p = plan(spec, get_device("L4"), PlanOptions(contexts=(2048,), turn_tokens=turn_tokens))
    assert [t for t, _, _ in p.turns] == rows
    assert p.context_full_turn == full_turn


def test_quantized_concurrency_counts_the_residual_block(real_spec):
    """An int4 request at 8K holds 512 int4 blocks plus its window at full precision (two bf16
    blocks at R 32): per 16-token block and KV head 2 x 16 x 64 code bytes + values' scales
    (16 tokens x 4 groups x 4 B) + keys' per-channel scales (128 x 4 B); bf16: 2 x 16 x 128 x 2."""
    spec = real_spec("meta-llama__Llama-3.1-8B")
    p = plan(spec, get_device("H100-SXM"),
             PlanOptions(contexts=(8192,), kv_format="int4", kv_key_quant="per-channel",
                         kv_residual_tokens=32, kv_intact_tokens=0))
    int4_block = 32 * 8 * (2 * 16 * 64 + 16 * 4 * 4 + 128 * 4)
    bf16_block = 32 * 8 * 2 * 16 * 128 * 2
    assert p.block_bytes == int4_block
    assert p.contexts[0].max_concurrency == p.pool_bytes // (512 * int4_block + 2 * bf16_block)
    # the defaults: a window of 128 tokens and 32 intact tokens held twice, 8 + 2 x 2 blocks
    default = plan(spec, get_device("H100-SXM"), PlanOptions(contexts=(8192,), kv_format="int4"))
    assert default.contexts[0].max_concurrency == \
        default.pool_bytes // (512 * int4_block + 12 * bf16_block)
    tokenwise = plan(spec, get_device("H100-SXM"), PlanOptions(
        contexts=(8192,), kv_format="int4", kv_key_quant="per-token", kv_outlier_channels=4))
    assert tokenwise.block_bytes == 32 * 8 * (2 * 16 * 64 + 2 * 16 * 4 * 4 + 16 * 4 * 2)
