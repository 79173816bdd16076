"""Prometheus metrics of the server, under vLLM's names with the prefix ``kvledger:``.

A dashboard built for vLLM ports by swapping ``vllm:`` for ``kvledger:`` (vLLM docs, "Production
Metrics"): gauges ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``
(a 0-1 fraction, as in vLLM); counters ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens),
``num_preemptions``, ``prompt_tokens``, ``generation_tokens``, ``request_success{finished_reason}``;
histograms ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``request_time_per_output_token_seconds``,
``e2e_request_latency_seconds``, ``request_queue_time_seconds``. Ours: ``request_kv_bytes``
(each request's peak KV bytes), gauges ``kv_bytes_allocated`` and ``kv_bytes_predicted`` (the
ledger's figure for the tokens held), ``kv_blocks_total`` / ``kv_blocks_free`` /
``kv_blocks_evictable`` (free counts the evictable ones: at idle free == total, nothing
leaked), ``grammar_cache_bytes`` (the estimated bytes of the compiled structured-output
constraints cached, within ``--grammar-cache-mib``), speculative decoding's counters
(``spec_*_tokens``, :mod:`.spec_metrics`),
counters ``prefix_cache_requeries`` / ``prefix_cache_rehits`` (lookups of re-admissions after a
preemption, kept out of the prompt hit rate), ``kv_quota_rejections`` and ``kv_alerts``; the KV
tiers' series (``kv_tier_*{tier}``) in :mod:`.tier_metrics`.

Every metric carries the label ``model_name``, as vLLM's do; the ones routers and endpoint pickers
read are also exposed under vLLM's names, and with ``--metrics-compat vllm`` every one with a vLLM
counterpart (:mod:`.vllm_metrics`). Each server owns its own registry,
so several apps can live in one process (tests); ``*_created``
series are disabled process-wide, as vLLM does. prometheus-client is thread-safe: the engine
thread records, the HTTP thread renders.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from kvledger.server.metrics.spec_metrics import SpecMetrics
from kvledger.server.metrics.tier_metrics import TierMetrics
from kvledger.server.metrics.vllm_metrics import ROUTER_NAMES, VLLM_NAMES, vllm_registry

PREFIX = "kvledger:"

disable_created_metrics()  # no ``*_created`` series, as in vLLM

# Buckets in seconds, spanning CPU and GPU speeds (vLLM's are similar).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)
# Bytes: 4 KiB .. 64 GiB, by powers of 4.
KV_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(1, 14))

STAT_GAUGES = {  # gauge name -> engine.stats() key
    "num_requests_running": "num_running",
    "num_requests_waiting": "num_waiting",
    "kv_cache_usage_perc": "kv_usage",
    "kv_bytes_allocated": "kv_bytes_allocated",
    "kv_bytes_predicted": "kv_bytes_predicted",
    "kv_blocks_total": "kv_blocks_total",
    "kv_blocks_free": "kv_blocks_free",
    "kv_blocks_evictable": "kv_blocks_evictable",
    "kv_blocks_touched": "kv_blocks_touched",
    "grammar_cache_bytes": "grammar_cache_bytes",
}
STAT_COUNTERS = {  # counter name -> cumulative engine.stats() key
    "prefix_cache_queries": "prefix_cache_queried_tokens",
    "prefix_cache_hits": "prefix_cache_hit_tokens",
    "prefix_cache_requeries": "prefix_cache_requeried_tokens",
    "prefix_cache_rehits": "prefix_cache_rehit_tokens",
    "prefix_cache_missed": "prefix_cache_missed_tokens",
    "num_preemptions": "num_preemptions",
}


class ServerMetrics:
    """All metrics of one server; ``render()`` gives the text exposition format."""

    def __init__(self, model_name: str, vllm_names: bool = False) -> None:
        self.registry = CollectorRegistry()
        # under vLLM's names too: what routers read, or with --metrics-compat vllm every one
        self._vllm = vllm_registry(self.registry, PREFIX,
                                   VLLM_NAMES if vllm_names else ROUTER_NAMES)
        self._model = model_name
        self._last_cumulative: dict[str, float] = {}
        self.gauges = {name: self._make(Gauge, name, doc) for name, doc in (
            ("num_requests_running", "Requests in the running batch."),
            ("num_requests_waiting", "Requests waiting to be scheduled."),
            ("kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)."),
            ("kv_bytes_allocated", "Bytes of KV blocks allocated to requests."),
            ("kv_bytes_predicted", "Ledger's KV bytes for the tokens held."),
            ("kv_blocks_total", "KV blocks in the pool."),
            ("kv_blocks_free", "KV blocks on the free list (cached ones included)."),
            ("kv_blocks_evictable", "Free KV blocks still holding a prefix-cache entry."),
            ("kv_blocks_touched", "KV blocks allocated at least once (pages mapped so far)."),
            ("grammar_cache_bytes", "Estimated bytes of the cached compiled constraints."),
        )}
        self.counters = {name: self._make(Counter, name, doc) for name, doc in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (once each)."),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            ("prefix_cache_requeries", "Tokens looked up again on re-admission after preemption."),
            ("prefix_cache_rehits", "Tokens found again on re-admission after preemption."),
            ("prefix_cache_missed", "Prompt tokens a sliding layer group's evictions kept from a hit."),
            ("num_preemptions", "Preemptions of running requests."),
            ("prompt_tokens", "Prefilled prompt tokens."),
            ("generation_tokens", "Generated tokens."),
            ("kv_quota_rejections", "Requests refused because their KV exceeds the quota."),
            ("kv_alerts", "Requests whose KV passed the alert threshold."),
        )}
        self.pool_bytes = self._make(
            Gauge, "kv_pool_bytes", "Bytes of each tensor-parallel rank's KV pool tensors.",
            ["rank"])
        self.tiers = TierMetrics(self._make)
        self.spec = SpecMetrics(self._make)
        self.request_success = self._make(
            Counter, "request_success", "Finished requests by finish reason.", ["finished_reason"]
        )
        self.histograms = {name: self._make(Histogram, name, doc, buckets=b) for name, doc, b in (
            ("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
            ("inter_token_latency_seconds", "Time between two output steps.", ITL_BUCKETS),
            ("request_time_per_output_token_seconds",
             "Mean time per output token after the first (TPOT), per request.", ITL_BUCKETS),
            ("e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS),
            ("request_queue_time_seconds", "Arrival to first scheduled.", E2E_BUCKETS),
            ("request_kv_bytes", "Peak KV bytes of each request.", KV_BYTES_BUCKETS),
        )}

    def set_cache_config(self, config: dict[str, str]) -> None:
        """Publish the KV cache configuration as ``cache_config_info`` (value 1, the settings as
        labels, as vLLM does)."""
        info = self._make(Gauge, "cache_config_info", "KV cache configuration.", sorted(config))
        info.labels(model_name=self._model, **config).set(1)

    def _make(self, kind, name, doc, labels=(), **kwargs):
        metric = kind(PREFIX + name, doc, ["model_name", *labels], registry=self.registry,
                      **kwargs)
        return metric if labels else metric.labels(model_name=self._model)

    def update_from_stats(self, stats: dict) -> None:
        """Set gauges and advance counters from ``engine.stats()`` (cumulative counters)."""
        for name, key in STAT_GAUGES.items():
            if key in stats:
                self.gauges[name].set(stats[key])
        per_rank = stats.get("kv_pool_bytes_per_rank") or (
            [stats["kv_pool_bytes"]] if "kv_pool_bytes" in stats else [])
        for rank, nbytes in enumerate(per_rank):
            self.pool_bytes.labels(model_name=self._model, rank=str(rank)).set(nbytes)
        self.tiers.update(self._model, stats)
        self.spec.update(self._model, stats)
        for name, key in STAT_COUNTERS.items():
            value = stats.get(key)
            if value is None:
                continue
            delta = value - self._last_cumulative.get(key, 0)
            if delta > 0:
                self.counters[name].inc(delta)
            self._last_cumulative[key] = value

    def count_finished(self, finish_reason: str) -> None:
        """One more finished request with this reason (stop, length, abort, error)."""
        self.request_success.labels(model_name=self._model, finished_reason=finish_reason).inc()

    def render(self) -> bytes:
        """Prometheus text exposition of every metric and of their vLLM names."""
        return generate_latest(self.registry) + generate_latest(self._vllm)
