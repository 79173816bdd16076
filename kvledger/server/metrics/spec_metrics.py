"""Prometheus metrics of speculative decoding (docs/speculative.md), from ``engine.stats()``:
counters ``spec_proposed_tokens`` / ``spec_accepted_tokens`` (tokens verified and accepted,
all methods) and ``spec_method_proposed_tokens`` / ``spec_method_accepted_tokens`` with the
label ``method`` (``ngram``, ``suffix``, ``draft_model``: the proposer that found them); acceptance per method
is the ratio of the two."""

from __future__ import annotations

from prometheus_client import Counter

from kvledger.engine.spec.config import METHODS

TOTALS = {  # counter -> engine.stats() key
    "spec_proposed_tokens": ("spec_proposed_tokens", "Proposed tokens verified."),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Proposed tokens accepted."),
}
PER_METHOD = {
    "spec_method_proposed_tokens": ("spec_proposed_tokens_", "Proposed tokens verified, by method."),
    "spec_method_accepted_tokens": ("spec_accepted_tokens_", "Proposed tokens accepted, by method."),
}


class SpecMetrics:
    """The counters above, advanced from the engine's cumulative figures."""

    def __init__(self, make) -> None:
        self.totals = {name: make(Counter, name, doc) for name, (_, doc) in TOTALS.items()}
        self.per_method = {name: make(Counter, name, doc, ["method"])
                           for name, (_, doc) in PER_METHOD.items()}
        self._last: dict[str, int] = {}

    def update(self, model: str, stats: dict) -> None:
        """Advance every counter by what ``stats`` gained since the last call."""
        for name, (key, _) in TOTALS.items():
            self._advance(stats, key, self.totals[name])
        for name, (prefix, _) in PER_METHOD.items():
            for method in METHODS:
                if prefix + method in stats:
                    self._advance(stats, prefix + method,
                                  self.per_method[name].labels(model_name=model, method=method))

    def _advance(self, stats: dict, key: str, counter) -> None:
        value = stats.get(key)
        if value is None:
            return
        if value > self._last.get(key, 0):
            counter.inc(value - self._last.get(key, 0))
        self._last[key] = value
