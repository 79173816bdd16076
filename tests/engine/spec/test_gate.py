"""The gate's measurements: the step price fitted on observed steps, acceptance per request
shrunk towards its method's rate, and k cut to 0 where steps are priced per token."""

from __future__ import annotations

import pytest

from kvledger.engine.request import Request
from kvledger.engine.spec.gate import PRIOR_PRICE, Gate


def test_price_is_the_least_squares_line_of_the_steps():
    gate = Gate()
    for tokens, seconds in [(1, 0.011), (6, 0.016), (1, 0.011), (11, 0.021)]:
        gate.observe_step(tokens, seconds)
    price = gate.price()
    assert price.fixed_s == pytest.approx(0.010) and price.per_token_s == pytest.approx(0.001)


def test_price_before_two_step_sizes_is_the_prior_shape_scaled():
    gate = Gate()
    assert gate.price() == PRIOR_PRICE
    gate.observe_step(1, 0.0165)  # PRIOR_PRICE(1) = 1 + 1/32 = 1.03125 units
    assert gate.price()(1) == pytest.approx(0.0165)
    assert gate.price().per_token_s / gate.price().fixed_s == pytest.approx(1 / 32)


def test_acceptance_per_request_shrinks_to_the_method_rate():
    gate, a, b = Gate(), Request("a", [1]), Request("b", [1])
    gate.record(a, "ngram", accepted=8, rejected=False)  # method: 8 hits, 0 misses
    assert gate.method_rate("ngram") == pytest.approx(9 / 10)
    assert gate.acceptance(a, "ngram") == pytest.approx((8 + 2 * 0.9) / (8 + 2))
    assert gate.acceptance(b, "ngram") == pytest.approx(0.9)  # a new request: the method's
    gate.record(b, "ngram", accepted=0, rejected=True)
    assert gate.acceptance(b, "ngram") < gate.acceptance(a, "ngram")


def test_steps_priced_per_token_get_no_drafts():
    gate = Gate()
    for tokens in (16, 20, 24, 16, 20, 24):
        gate.observe_step(tokens, 0.0001 + 0.001 * tokens)  # compute-bound: all per token
    assert gate.choose([0.7] * 16, [5] * 16, tokens=16, sampling=16) == [0] * 16
    assert Gate(enabled=False).choose([0.1], [3], tokens=1, sampling=1) == [3]
