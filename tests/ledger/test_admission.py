"""The admission rule (ledger/admission.py) against hand-worked cases and a brute-force count."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvledger.ledger.admission import RequestBudget, blocks_for_kv_tokens, kv_tokens_of


@pytest.mark.parametrize("kv_tokens, block_size, blocks", [
    (0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (47, 4, 12), (2048, 16, 128)])
def test_blocks_for_kv_tokens_by_hand(kv_tokens, block_size, blocks):
    assert blocks_for_kv_tokens(kv_tokens, block_size) == blocks


def test_the_last_sampled_token_takes_no_slot():
    assert [kv_tokens_of(t) for t in (0, 1, 2, 48)] == [0, 0, 1, 47]


def test_pool_bound():
    # 4 blocks of 16 = 64 slots; 64 KV tokens + the last sampled one = 65 tokens at most.
    b = RequestBudget(block_size=16, max_blocks=4, context_tokens=2048)
    assert b.max_total_tokens == 65
    assert b.exceeded_by(65) is None and b.exceeded_by(66) == "kv"


def test_quota_and_context_bind_before_the_pool():
    assert RequestBudget(16, 4, 2048, quota_tokens=50).max_total_tokens == 50
    assert RequestBudget(16, 4, 2048, quota_tokens=50).exceeded_by(51) == "quota"
    assert RequestBudget(16, 4, 40).max_total_tokens == 40
    assert RequestBudget(16, 4, 40, quota_tokens=30).exceeded_by(41) == "context"


def test_the_scheduler_test_case():
    # prompt 40 + max_tokens 8 on 8 blocks of 4: 47 KV tokens = 12 blocks > 8 (test_scheduler).
    b = RequestBudget(block_size=4, max_blocks=8, context_tokens=4096)
    assert b.exceeded_by(48) == "kv" and b.max_total_tokens == 33


@given(bs=st.integers(1, 32), blocks=st.integers(0, 20), context=st.integers(1, 700),
       quota=st.none() | st.integers(1, 700), total=st.integers(1, 800))
def test_limit_agrees_with_filling_blocks_one_token_at_a_time(bs, blocks, context, quota, total):
    """Brute force: feed tokens one by one into blocks; the request fits when every KV slot it
    fills finds room, and it is within the context and the quota."""
    blocks_used = 0
    for slot in range(total - 1):  # the last sampled token is never fed back
        if slot == blocks_used * bs:  # every slot of the open blocks is taken: open one more
            blocks_used += 1
    fits = blocks_used <= blocks and total <= context and (quota is None or total <= quota)
    b = RequestBudget(bs, blocks, context, quota)
    assert (b.exceeded_by(total) is None) == fits == (total <= b.max_total_tokens)
