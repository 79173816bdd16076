"""Block arithmetic and the one admission rule (``KVRoom``), against hand counts and a vLLM log.

The engine's pool holds ``blocks x block_size`` token slots; a request of prompt + max_tokens =
T tokens writes K/V for T - 1 of them (the last sampled token is never fed back).
"""

from __future__ import annotations

import pytest

from kvledger.errors import InvalidParameterError, KVBudgetError
from kvledger.ledger.blocks import (
    KVRoom,
    blocks_for,
    blocks_for_tokens,
    concurrency_ratio,
    request_kv_tokens,
)

MiB, GiB = 2**20, 2**30


def test_block_counts_by_hand():
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert request_kv_tokens(10) == 9 and request_kv_tokens(1) == 0
    assert blocks_for(10 * 2 * MiB + 5, 2 * MiB) == 10
    assert blocks_for(-1, 2 * MiB) == 0
    with pytest.raises(InvalidParameterError):
        blocks_for(100, 0)


def test_vllm_log_pool_and_concurrency():
    """vLLM, Llama-3.1-8B bf16 block 16 (2 MiB blocks): "# GPU blocks: 1952", "Maximum
    concurrency for 20,000 tokens per request: 1.56x" (20,000 tokens = 1,250 blocks)."""
    assert blocks_for(int(3.8125 * GiB), 2 * MiB) == 1952
    assert blocks_for_tokens(20_000, 16) == 1250
    assert round(concurrency_ratio(1952, 20_000, 16), 2) == 1.56


def test_a_request_that_fills_the_pool_exactly_fits():
    """4 blocks of 16 = 64 slots: prompt + max_tokens = 65 needs 64 slots (fits), 66 needs 65."""
    room = KVRoom(block_size=16, blocks=4)
    assert room.refusal(65) is None
    room.check(65)
    assert room.holds(64) and not room.holds(65)
    reason = room.refusal(66, "request 'r'")
    assert reason == (
        "request 'r' needs up to 65 KV tokens = 5 blocks but the KV pool holds 4 blocks; "
        "lower max_tokens or raise --kv-cache-gib / --num-blocks"
    )
    with pytest.raises(KVBudgetError, match="needs up to 65 KV tokens = 5 blocks"):
        room.check(66)


def test_the_quota_is_checked_first_and_bytes_are_named():
    room = KVRoom(block_size=16, blocks=4, quota_tokens=50, bytes_per_block=1000,
                  where="the long-request share of the KV pool")
    assert room.refusal(50) is None
    assert "per-request KV quota of 50 tokens" in room.refusal(51)
    big = KVRoom(block_size=16, blocks=4, bytes_per_block=1000,
                 where="the long-request share of the KV pool")
    assert big.refusal(100) == (
        "the request needs up to 99 KV tokens = 7 blocks (7000 bytes) but the long-request "
        "share of the KV pool holds 4 blocks (4000 bytes); lower max_tokens or raise "
        "--kv-cache-gib / --num-blocks"
    )


def test_longest_request_is_the_least_of_context_pool_and_quota():
    assert KVRoom(16, 4).max_total_tokens(context=8192) == 65  # 64 slots + the last token
    assert KVRoom(16, 4).max_total_tokens(context=40) == 40
    assert KVRoom(16, 4, quota_tokens=30).max_total_tokens(context=8192) == 30
    assert KVRoom(16, 0).max_total_tokens(context=8192) == 0  # not even a prompt fits
    for total in (2, 30, 65):  # everything up to the longest fits, one more does not
        assert KVRoom(16, 4).refusal(total) is None
    assert KVRoom(16, 4).refusal(66) is not None
    with pytest.raises(InvalidParameterError):
        KVRoom(0, 4)
