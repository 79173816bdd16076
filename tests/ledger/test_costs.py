"""Costs against the seed's worked numbers (§3.2-§3.4, §5.2) and a real vLLM log."""

from __future__ import annotations

import pytest

from kvledger.ledger import costs
from kvledger.ledger.kv import kv_bytes_per_block, kv_bytes_per_sequence
from kvledger.ledger.kv_format import KVFormatSpec

FP16 = KVFormatSpec("fp16")
from kvledger.ledger.params import count_params

GiB, MiB = 2**30, 2**20


def test_seed_concurrency_mha_vs_gqa8(real_spec):
    """Seed §3.4 / §5.2: 80 GB card - 14 GB weights - 10 GB reserve = 56 GB for KV (the seed's
    GB are GiB: "divide by 1024^3"); 8K requests: 14 at once (MHA), 56 (GQA-8); 32K: 3-4."""
    import dataclasses

    pool = costs.kv_pool_bytes(80 * GiB, 14 * GiB, 10 * GiB, utilization=1.0)
    assert pool == 56 * GiB
    mha = real_spec("meta-llama__Llama-2-7b-hf")
    gqa = dataclasses.replace(mha, num_kv_heads=8)
    per_8k = kv_bytes_per_sequence(mha, FP16, 1, 16, 8192, paged=True)
    assert costs.max_concurrency(pool, per_8k) == 14
    assert (
        costs.max_concurrency(pool, kv_bytes_per_sequence(gqa, FP16, 1, 16, 8192, paged=True)) == 56
    )
    assert costs.max_concurrency(pool, kv_bytes_per_sequence(mha, FP16, 1, 16, 32768)) == 3


def test_seed_prefill_flops_7b_8k(real_spec):
    """Seed §3.3: 2 x 7e9 x 8192 ~ 115 TFLOPs; < 0.5 s at 300 TFLOPS, ~1 s at 30-50 % MFU."""
    seed = 2 * 7e9 * 8192
    assert round(seed / 1e12) == 115
    assert costs.ttft_s(seed, 300e12, mfu=1.0) < 0.5
    assert 0.7 < costs.ttft_s(seed, 300e12, mfu=0.5) < costs.ttft_s(seed, 300e12, mfu=0.3) < 1.3
    spec = real_spec("meta-llama__Llama-2-7b-hf")
    active = count_params(spec).active
    attention = 32 * 2 * 32 * (128 + 128) * (8192 * 8193 // 2)  # layers x 2 x heads x dims x pairs
    assert costs.attention_flops(spec, 8192) == attention
    assert costs.prefill_flops(spec, 8192, active) == 2 * active * 8192 + attention
    assert abs(2 * active * 8192 / 1e12 - 115) / 115 < 0.05  # 6.74 B params, not 7


def test_seed_tpot_floor():
    """Seed §3.2: 14 GB weights + 4 GB KV = 18 GB per step at 2-3 TB/s -> 6-9 ms; 32K: 30 GB ->
    10-15 ms."""
    assert costs.tpot_floor_s(14e9, 4e9, 3e12) == pytest.approx(6e-3)
    assert costs.tpot_floor_s(14e9, 4e9, 2e12) == pytest.approx(9e-3)
    assert costs.tpot_floor_s(14e9, 16e9, 3e12) == pytest.approx(10e-3)
    assert costs.tpot_floor_s(14e9, 16e9, 2e12) == pytest.approx(15e-3)


def test_vllm_log_llama31_8b(real_spec):
    """A real vLLM log (Llama-3.1-8B, bf16, block 16): "KV cache 3.81 GiB", "# GPU blocks: 1952"
    (31,232 tokens), "Maximum concurrency for 20,000 tokens per request: 1.56x". A block is
    2 x 8 x 128 x 32 x 2 x 16 = 2 MiB, so 1952 blocks are 3.8125 GiB, which the log rounds to
    3.81 (3.81 GiB exactly would be 1950 blocks)."""
    block = kv_bytes_per_block(real_spec("meta-llama__Llama-3.1-8B"), KVFormatSpec(), 1, 16)
    assert block == 2 * 8 * 128 * 32 * 2 * 16 == 2 * MiB
    assert round(1952 * block / GiB, 2) == 3.81
    assert costs.blocks_for(1952 * block, block) == 1952
    assert costs.blocks_for(int(3.81 * GiB), block) == 1950
    assert 1952 * 16 == 31_232
    assert round(costs.concurrency_ratio(1952, 20_000, 16), 2) == 1.56 == round(31232 / 20000, 2)


def test_causal_pairs():
    assert costs.causal_pairs(4) == 1 + 2 + 3 + 4
    assert costs.causal_pairs(4, window=2) == 1 + 2 + 2 + 2
    assert costs.causal_pairs(4, window=8) == 10


def test_shared_prefix_is_stored_once():
    # pool 10, request 3 of which 1 is shared: 1 + 2 + 2 + 2 + 2 = 9 <= 10 -> 4 requests
    assert costs.max_concurrency(10, 3, shared_bytes=1) == 4
    assert costs.max_concurrency(10, 3) == 3
    assert costs.max_concurrency(2, 3) == 0


def test_pool_and_bad_arguments():
    assert costs.kv_pool_bytes(100, 20, 10, utilization=0.5) == 20
    assert costs.blocks_for(-5, 4) == 0
    from kvledger.errors import InvalidParameterError

    for call in (lambda: costs.kv_pool_bytes(100, 0, 0, 1.5), lambda: costs.ttft_s(1, 1, mfu=0)):
        with pytest.raises(InvalidParameterError):
            call()
