"""What speculative decoding gains: expected tokens per verify and the step's best drafts.

A sequence that verifies ``k`` proposed tokens, each accepted with probability ``a`` while the
ones before it were (the i.i.d. model of Leviathan et al. 2023, arXiv:2211.17192, §3.1), emits

    E(a, k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (the accepted ones and the verify step's own token). A step of ``T`` tokens costs
``price(T)`` seconds (:class:`StepPrice`: a fixed part, the weights read once, and a part per
token computed). Speculation pays where it raises tokens emitted per second: the step's
``N`` sampling sequences emit ``N + sum_i (E(a_i, k_i) - 1)`` tokens in ``price(T + sum_i k_i)``.
:func:`choose_drafts` adds draft tokens one at a time in order of their expected gain ``a_i^j``
(the j-th token of sequence i) and keeps the count that maximises that rate; where a step is
priced by its tokens (large batches, compute-bound) or acceptance is low, it keeps none.

Pure arithmetic, no torch: the engine (``engine/spec/gate.py``) measures the acceptance and the
price, this module decides.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(acceptance: float, k: int) -> float:
    """E(a, k): tokens a verify of ``k`` proposals emits (the step's own token included)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def break_even_acceptance(price: StepPrice, tokens: int, k: int) -> float:
    """Least acceptance at which one sequence verifying ``k`` proposals in a step of
    ``tokens`` tokens emits tokens as fast as a plain step (bisection on E, which grows with
    the acceptance); 1.0 when even full acceptance does not pay."""
    ratio = price(tokens + k) / price(tokens)
    if expected_tokens(1.0, k) < ratio:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < ratio else (lo, mid)
    return hi


@dataclass(frozen=True)
class StepPrice:
    """Seconds of a step of ``T`` tokens: ``fixed_s + per_token_s * T``."""

    fixed_s: float
    per_token_s: float

    def __call__(self, tokens: int) -> float:
        return self.fixed_s + self.per_token_s * tokens


def choose_drafts(acceptance: list[float], available: list[int], tokens: int, sampling: int,
                  price: StepPrice) -> list[int]:
    """Draft tokens to verify per sequence (see the module docstring).

    Args:
        acceptance: each proposing sequence's acceptance estimate.
        available: tokens each one has proposed (the most it may verify).
        tokens: tokens the step computes without drafts.
        sampling: sequences of the step that sample a token (each emits one without drafts).
        price: the step price.
    """
    gains = sorted(((a ** j, i) for i, (a, n) in enumerate(zip(acceptance, available))
                    for j in range(1, n + 1)), reverse=True)
    best, best_rate, emitted = 0, sampling / price(tokens), float(sampling)
    for m, (gain, _) in enumerate(gains, 1):
        emitted += gain
        rate = emitted / price(tokens + m)
        if rate > best_rate:
            best, best_rate = m, rate
    ks = [0] * len(acceptance)
    for _, i in gains[:best]:
        ks[i] += 1
    return ks
