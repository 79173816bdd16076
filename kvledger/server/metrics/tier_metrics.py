"""Prometheus metrics of the KV tiers below the pool (docs/kv-tiers.md), one series per tier
(label ``tier``: ``ram``, ``disk``), from ``engine.stats()["kv_tiers"]``.

Counters (blocks or bytes since start): ``kv_tier_hits``, ``kv_tier_misses``,
``kv_tier_bytes_read``, ``kv_tier_bytes_written``, ``kv_tier_load_seconds``,
``kv_tier_corrupt_files`` (never used, recomputed), ``kv_tier_write_errors``; gauges
``kv_tier_blocks``, ``kv_tier_bytes``, ``kv_tier_capacity_bytes``, ``kv_tier_enabled`` (0 once a
full disk turned it off). For the chain: ``kv_tier_dropped_writes`` (the write queue was full),
``kv_tier_deferred_loads`` (tier hits not loaded: the pool could not admit the request yet)
and ``kv_tier_recomputed_blocks`` (found in a tier, recomputed because the ledger predicted
loading slower).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

COUNTERS = {  # metric -> TierStats field
    "kv_tier_hits": ("hits", "KV blocks loaded from the tier."),
    "kv_tier_misses": ("misses", "Tier lookups that found no block."),
    "kv_tier_bytes_read": ("bytes_read", "Payload bytes read from the tier."),
    "kv_tier_bytes_written": ("bytes_written", "Payload bytes written to the tier."),
    "kv_tier_load_seconds": ("load_seconds", "Seconds spent loading blocks from the tier."),
    "kv_tier_corrupt_files": ("corrupt_files", "Block files that failed a check (recomputed)."),
    "kv_tier_write_errors": ("write_errors", "Block writes that failed."),
}
GAUGES = {
    "kv_tier_blocks": ("blocks", "KV blocks held by the tier."),
    "kv_tier_bytes": ("bytes_held", "Bytes held by the tier."),
    "kv_tier_capacity_bytes": ("capacity_bytes", "Most bytes the tier keeps."),
}
CHAIN_COUNTERS = {
    "kv_tier_dropped_writes": "Blocks not written to the tiers because the queue was full.",
    "kv_tier_recomputed_blocks": "Tier blocks recomputed because loading was predicted slower.",
    "kv_tier_deferred_loads": "Tier hits not loaded because the pool could not admit the "
                              "request yet.",
}


class TierMetrics:
    """The tier series of one registry; ``update`` takes ``engine.stats()``."""

    def __init__(self, make) -> None:
        """``make(kind, name, doc, labels)``: ServerMetrics' metric factory."""
        self.counters = {n: make(Counter, n, doc, ["tier"]) for n, (_, doc) in COUNTERS.items()}
        self.gauges = {n: make(Gauge, n, doc, ["tier"]) for n, (_, doc) in GAUGES.items()}
        self.enabled = make(Gauge, "kv_tier_enabled", "1 while the tier takes writes.", ["tier"])
        self.chain = {n: make(Counter, n, doc, ["tier"]) for n, doc in CHAIN_COUNTERS.items()}
        self._last: dict[tuple, float] = {}

    def _advance(self, metric, labels: tuple, value: float) -> None:
        delta = value - self._last.get((id(metric), labels), 0)
        if delta > 0:
            metric.labels(*labels).inc(delta)
        self._last[(id(metric), labels)] = value

    def update(self, model: str, stats: dict) -> None:
        for tier, s in stats.get("kv_tiers", {}).items():
            labels = (model, tier)
            for name, (field, _) in COUNTERS.items():
                self._advance(self.counters[name], labels, s[field])
            for name, (field, _) in GAUGES.items():
                self.gauges[name].labels(*labels).set(s[field])
            self.enabled.labels(*labels).set(0 if s["disabled"] else 1)
        if "kv_tiers" in stats:
            for name in CHAIN_COUNTERS:
                self._advance(self.chain[name], (model, "all"), stats[name])
