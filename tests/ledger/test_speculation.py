"""The gate's arithmetic (``ledger/speculation.py``), checked by hand."""

from __future__ import annotations

import pytest

from kvledger.ledger.speculation import (
    StepPrice,
    break_even_acceptance,
    choose_drafts,
    expected_tokens,
)


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0


def test_a_memory_bound_step_takes_every_likely_draft():
    """Batch 1 on a price of 1 + T/100: four drafts at acceptance 0.8 emit 3.36 tokens in
    1.05 units against 1 in 1.01."""
    price = StepPrice(1.0, 0.01)
    assert choose_drafts([0.8], [4], tokens=1, sampling=1, price=price) == [4]


def test_a_compute_bound_step_takes_none():
    """When every token costs as much as the fixed part, a draft at 0.5 adds 0.5 tokens for
    one token's price: a step of 16 decodes emits 16 in 17 units; with one draft 16.5 in 18."""
    price = StepPrice(1.0, 1.0)
    assert choose_drafts([0.5] * 16, [4] * 16, tokens=16, sampling=16, price=price) == [0] * 16


def test_drafts_go_to_the_likeliest_sequences_first():
    """Price 1 + T/10 at batch 2: gains 0.9, 0.81, 0.73, 0.66 of the first sequence beat
    0.2 of the second; the fifth draft (0.2) would cost more than it brings."""
    ks = choose_drafts([0.9, 0.2], [4, 4], tokens=2, sampling=2, price=StepPrice(1.0, 0.1))
    assert ks == [4, 0]


def test_break_even_acceptance():
    """k = 1 at price 1 + T: one draft doubles a 1-token step's cost (2 -> 3 units, ratio 1.5)
    so it pays from E = 1 + a >= 1.5, a = 0.5."""
    assert break_even_acceptance(StepPrice(1.0, 1.0), 1, 1) == pytest.approx(0.5, abs=1e-6)
    # all price per token: 4 drafts cost 5x, E = 5 only at full acceptance
    assert break_even_acceptance(StepPrice(0.0, 1.0), 1, 4) == pytest.approx(1.0)
