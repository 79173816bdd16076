"""The gate's arithmetic (``ledger/speculation.py``), checked by hand."""

from __future__ import annotations

import pytest

from kvledger.ledger.hardware import Device
from kvledger.ledger.speculation import (
    VerifyStep,
    break_even_acceptance,
    choose_drafts,
    expected_tokens,
)
from kvledger.ledger.step_model import Efficiency, StepFeatures, StepTimeModel
from kvledger.model.catalogue import load_model_spec


def linear(fixed: float, per_token: float, tokens: int):
    """A step of ``tokens`` plain tokens priced ``fixed + per_token x T`` (drafts included)."""
    return lambda ks: fixed + per_token * (tokens + sum(ks))


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0


def test_a_memory_bound_step_takes_every_likely_draft():
    """Batch 1 on a price of 1 + T/100: four drafts at acceptance 0.8 emit 3.36 tokens in
    1.05 units against 1 in 1.01."""
    assert choose_drafts([0.8], [4], sampling=1, price=linear(1.0, 0.01, 1)) == [4]


def test_a_compute_bound_step_takes_none():
    """When every token costs as much as the fixed part, a draft at 0.5 adds 0.5 tokens for
    one token's price: a step of 16 decodes emits 16 in 17 units; with one draft 16.5 in 18."""
    price = linear(1.0, 1.0, 16)
    assert choose_drafts([0.5] * 16, [4] * 16, sampling=16, price=price) == [0] * 16


def test_drafts_go_to_the_likeliest_sequences_first():
    """Price 1 + T/10 at batch 2: gains 0.9, 0.81, 0.73, 0.66 of the first sequence beat
    0.2 of the second; the fifth draft (0.2) would cost more than it brings."""
    ks = choose_drafts([0.9, 0.2], [4, 4], sampling=2, price=linear(1.0, 0.1, 2))
    assert ks == [4, 0]


def test_break_even_acceptance():
    """k = 1 at price 1 + T: one draft makes a 1-token step cost 1.5x (2 -> 3 units), so it
    pays from E = 1 + a >= 1.5, a = 0.5."""
    assert break_even_acceptance(1.5, 1) == pytest.approx(0.5, abs=1e-6)
    # all price per token: 4 drafts cost 5x, E = 5 only at full acceptance
    assert break_even_acceptance(5.0, 4) == pytest.approx(1.0)


SPEC = load_model_spec("HuggingFaceTB/SmolLM2-135M")
DEVICE = Device("test", memory_gib=16, bandwidth_gbs=15, tflops=0.2, source="test")
EFF = Efficiency(mfu=0.4, mbu=0.7, step_overhead_s=0.003, seq_overhead_s=0.0001, source="test",
                 decode_group_s=0.001, paged_mfu=0.1)


def test_verify_step_prices_the_planned_step_with_its_drafts():
    """A decode at 10, a prefill chunk of 8 at 0, a decode at 40 under an evicting policy, and
    two proposing decodes at 30 and 33 with drafts (2, 0): the target computes chunks (30, 3)
    and (33, 1) beside the others; the draft model runs two rounds of the one sequence that
    drafts, a decode at 30, then at 31."""
    model = StepTimeModel(SPEC, DEVICE, EFF)
    draft = StepTimeModel(SPEC, DEVICE, EFF)
    step = VerifyStep(model, [(10, 1), (0, 8)], [(40, 1)], [30, 33], sampled=4, draft=draft)
    target = model.duration(StepFeatures.of_parts([(10, 1), (0, 8), (30, 3), (33, 1)],
                                                  [(40, 1)], 4))
    rounds = draft.duration(StepFeatures.of([(30, 1)])) + draft.duration(
        StepFeatures.of([(31, 1)]))
    assert step([2, 0]) == pytest.approx(target + rounds)
    plain = model.duration(StepFeatures.of_parts([(10, 1), (0, 8), (30, 1), (33, 1)],
                                                 [(40, 1)], 4))
    assert step([0, 0]) == pytest.approx(plain)
    # without a draft model, proposals cost nothing to make
    assert VerifyStep(model, [(10, 1), (0, 8)], [(40, 1)], [30, 33], 4)([2, 0]) == \
        pytest.approx(target)
