"""The ledger's gate on speculation: how many proposed tokens each sequence verifies this step.

Each step's decision is :func:`kvledger.ledger.speculation.choose_drafts` over

- the acceptance of each proposing sequence: the geometric estimate ``hits / (hits + misses)``
  of its own verifies (a hit: a proposed token accepted; a miss: a verify that rejected one),
  shrunk towards the method's running rate by :data:`PRIOR_WEIGHT` pseudo-verifies, so a new
  request starts at what its method has been reaching. A proposal the gate turned down still
  counts its first token against the token the step emitted (free to measure), so a sequence
  whose acceptance rises gets drafts again;
- the step price, fitted on this engine's own steps: least squares of step seconds on step
  tokens over the last :data:`PRICE_WINDOW` steps (a fixed part, the weights read once, and a
  part per token). Until steps of two sizes were seen, the price is :data:`PRIOR_PRICE`'s
  shape scaled to the steps measured (a CPU decode of a small model reads its weights in the
  time of about 32 tokens' compute).

``gate: false`` in the config verifies every proposal (tests, measurements).
"""

from __future__ import annotations

from collections import deque

from kvledger.engine.request import Request
from kvledger.ledger.speculation import StepPrice, choose_drafts

PRIOR_WEIGHT = 2.0
"""Pseudo-verifies at the method's rate that a request's own acceptance is shrunk towards."""
PRICE_WINDOW = 256
"""Steps the price is fitted on."""
PRIOR_PRICE = StepPrice(fixed_s=1.0, per_token_s=1.0 / 32)
"""The price's shape before steps of two sizes were measured (scaled to the measured steps)."""


class Gate:
    """Acceptance estimates and the fitted step price (see the module docstring)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._steps: deque[tuple[int, float]] = deque(maxlen=PRICE_WINDOW)
        self.hits: dict[str, int] = {}
        self.misses: dict[str, int] = {}

    def method_rate(self, method: str) -> float:
        """The method's acceptance over every verify so far (0.5 before any)."""
        h, m = self.hits.get(method, 0), self.misses.get(method, 0)
        return (h + 1) / (h + m + 2)

    def acceptance(self, req: Request, method: str) -> float:
        """``req``'s acceptance estimate for proposals of ``method``."""
        h, m = req.spec_hits, req.spec_misses
        return (h + PRIOR_WEIGHT * self.method_rate(method)) / (h + m + PRIOR_WEIGHT)

    def record(self, req: Request, method: str, accepted: int, rejected: bool) -> None:
        """A verify (or the first token of a gated-off proposal) of ``req``: ``accepted``
        tokens, and whether one was rejected."""
        req.spec_hits += accepted
        req.spec_misses += int(rejected)
        self.hits[method] = self.hits.get(method, 0) + accepted
        self.misses[method] = self.misses.get(method, 0) + int(rejected)

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` tokens took ``seconds``."""
        self._steps.append((tokens, seconds))

    def price(self) -> StepPrice:
        """The step price fitted on the recent steps (see the module docstring)."""
        n = len(self._steps)
        if n == 0:
            return PRIOR_PRICE
        mean_t = sum(t for t, _ in self._steps) / n
        mean_s = sum(s for _, s in self._steps) / n
        var = sum((t - mean_t) ** 2 for t, _ in self._steps)
        if var > 0:
            slope = sum((t - mean_t) * (s - mean_s) for t, s in self._steps) / var
            fixed = mean_s - slope * mean_t
            if slope > 0:  # a negative intercept (noise, super-linear steps): no fixed part
                return StepPrice(max(fixed, 0.0), slope)
        scale = mean_s / PRIOR_PRICE(round(mean_t))
        return StepPrice(PRIOR_PRICE.fixed_s * scale, PRIOR_PRICE.per_token_s * scale)

    def choose(self, acceptance: list[float], available: list[int], tokens: int,
               sampling: int) -> list[int]:
        """Tokens each proposing sequence verifies this step (all it proposed when the gate
        is off)."""
        if not self.enabled:
            return list(available)
        return choose_drafts(acceptance, available, tokens, sampling, self.price())
