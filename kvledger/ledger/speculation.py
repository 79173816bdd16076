"""What speculative decoding gains: expected tokens per verify and the step's best drafts.

A sequence that verifies ``k`` proposed tokens, each accepted with probability ``a`` while the
ones before it were (the i.i.d. model of Leviathan et al. 2023, arXiv:2211.17192, §3.1), emits

    E(a, k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)

tokens (the accepted ones and the verify step's own token). Speculation pays where it raises
tokens emitted per second: the step's ``N`` sampling sequences emit ``N + sum_i (E(a_i, k_i) -
1)`` tokens in ``price(k_1, ..., k_n)`` seconds. :func:`choose_drafts` adds draft tokens one at
a time in order of their expected gain ``a_i^j`` (the j-th token of sequence i) and keeps the
count that maximises that rate; where a step is priced by its tokens (large batches,
compute-bound) or acceptance is low, it keeps none.

The price is the ledger's step model (:mod:`kvledger.ledger.step_model`, what ``kvledger
replay`` prices steps with and ``kvledger probe --steps`` fits), :class:`VerifyStep`: the step
as planned, each proposing decode ``(h, 1)`` turned into a chunk ``(h, 1 + k)`` (its ``k``
tokens more computed, their pairs attended through the paged kernel, the decode out of its
attention group); a draft model adds its own forwards, round ``j`` one decode of every
sequence drafting at least ``j`` tokens, priced by the draft's step model. Deterministic: the
same step, acceptance and model always give the same drafts.

Pure arithmetic, no torch: the engine (``engine/spec/gate.py``) measures the acceptance and
describes the step, this module decides.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvledger.ledger.step_model import StepFeatures, StepTimeModel


def expected_tokens(acceptance: float, k: int) -> float:
    """E(a, k): tokens a verify of ``k`` proposals emits (the step's own token included)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def break_even_acceptance(ratio: float, k: int) -> float:
    """Least acceptance at which a sequence verifying ``k`` proposals in a step that costs
    ``ratio`` x a plain one emits tokens as fast as the plain step (bisection on E, which grows
    with the acceptance); 1.0 when even full acceptance does not pay."""
    if expected_tokens(1.0, k) < ratio:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < ratio else (lo, mid)
    return hi


@dataclass(frozen=True)
class VerifyStep:
    """A planned step priced with drafts (see the module docstring).

    Attributes:
        model: the target's step model.
        plain: ``(context, new tokens)`` of the chunks under full retention that propose
            nothing; ``kept``: those under an evicting policy (context: what they hold).
        contexts: cached tokens of each decode that may propose.
        sampled: chunks of the step that sample a token.
        draft: the draft model's step model (None: proposals cost nothing to make).
    """

    model: StepTimeModel
    plain: list[tuple[int, int]]
    kept: list[tuple[int, int]]
    contexts: list[int]
    sampled: int
    draft: StepTimeModel | None = None

    def __call__(self, ks: list[int]) -> float:
        """Seconds of the step when decode ``i`` verifies ``ks[i]`` drafts."""
        chunks = [*self.plain, *((h, 1 + k) for h, k in zip(self.contexts, ks))]
        seconds = self.model.duration(StepFeatures.of_parts(chunks, self.kept, self.sampled))
        if self.draft is not None:
            for j in range(1, max(ks, default=0) + 1):
                rounds = [(h + j - 1, 1) for h, k in zip(self.contexts, ks) if k >= j]
                seconds += self.draft.duration(StepFeatures.of(rounds))
        return seconds


def choose_drafts(acceptance: list[float], available: list[int], sampling: int,
                  price: Callable[[list[int]], float]) -> list[int]:
    """Draft tokens to verify per sequence (see the module docstring).

    Args:
        acceptance: each proposing sequence's acceptance estimate.
        available: tokens each one has proposed (the most it may verify).
        sampling: sequences of the step that sample a token (each emits one without drafts).
        price: seconds of the step when sequence ``i`` verifies ``ks[i]`` drafts.
    """
    gains = sorted(((a ** j, i) for i, (a, n) in enumerate(zip(acceptance, available))
                    for j in range(1, n + 1)), reverse=True)
    ks = [0] * len(acceptance)
    best, best_rate, emitted = 0, sampling / price(ks), float(sampling)
    for m, (gain, i) in enumerate(gains, 1):
        ks[i] += 1
        emitted += gain
        rate = emitted / price(ks)
        if rate > best_rate:
            best, best_rate = m, rate
    ks = [0] * len(acceptance)
    for _, i in gains[:best]:
        ks[i] += 1
    return ks
