"""The plan as a whole: the seed's template end to end, the JSON contract, warnings, errors."""

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
    # TPOT floor: weights + one request's KV over 2 TB/s
    assert c8.tpot_floor_s == pytest.approx((weights + 4 * GiB) / 2e12)
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


def test_shared_prefix_raises_concurrency(real_spec):
    spec = real_spec("meta-llama__Llama-3.1-8B")
    p = plan(spec, get_device("H100-SXM"), PlanOptions(contexts=(8192,), shared_prefix=4096))
    row = p.contexts[0]
    per_request, shared = 8192 * 131072, 4096 * 131072
    assert row.shared_prefix_concurrency == (p.pool_bytes - shared) // (per_request - shared)
    assert row.shared_prefix_concurrency > row.max_concurrency


def test_formats_what_if(real_spec):
    p = plan(
        real_spec("meta-llama__Llama-3.1-8B"), get_device("H100-SXM"), PlanOptions(contexts=(8192,))
    )
    by = {f.kv_format: f for f in p.formats}
    assert by["fp8"].kv_bytes_per_sequence[0] * 2 == by["bf16"].kv_bytes_per_sequence[0]
    assert by["fp8"].max_concurrency[0] >= 2 * by["bf16"].max_concurrency[0]
    assert by["fp8"].tpot_floor_s[0] < by["bf16"].tpot_floor_s[0]


def test_moe_tpot_reads_active_experts_at_batch_1(real_spec):
    spec = real_spec("mistralai__Mixtral-8x7B-v0.1")
    p = plan(spec, get_device("H100-SXM"), PlanOptions(contexts=(1024,), tp=2))
    active_bytes = p.params_active * 2 / 2  # bf16, split over 2 ranks
    kv = 1024 * 32 * 2 * 4 * 128 * 2
    assert p.contexts[0].tpot_floor_s == pytest.approx((active_bytes + kv) / 3.35e12, rel=1e-6)


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
        PlanOptions(kv_format="int2"),
    ],
)
def test_bad_options(real_spec, opts):
    with pytest.raises(InvalidParameterError):
        plan(real_spec("meta-llama__Llama-3.1-8B"), get_device("H100-SXM"), opts)
