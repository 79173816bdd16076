"""The server's metrics that have a vLLM counterpart, also under vLLM's names and labels:
always the ones routers read (:data:`ROUTER_NAMES`), every one with ``--metrics-compat vllm``.

vLLM's dashboards, aiperf's server-metrics view and the Gateway API Inference Extension's
endpoint picker read ``vllm:`` names with the labels ``model_name`` and ``engine``. Each
counterpart below is the same quantity in the same unit (vLLM ``v1/metrics/loggers.py``); a
deprecated vLLM name still read by older tools is exposed too. The samples are copies of the
``kvledger:`` ones taken at each scrape, so the two never disagree. docs/vllm-compat.md lists the
mapping and the metrics without a counterpart.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

VLLM_ENGINE = "0"  # vLLM's ``engine`` label: the index of its engine core; one engine here

VLLM_NAMES: dict[str, tuple[str, ...]] = {  # our name (after ``kvledger:``) -> vLLM's names
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    # vllm:gpu_cache_usage_perc: the name until vLLM 0.9, still read by older endpoint pickers
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "num_preemptions": ("vllm:num_preemptions",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "request_success": ("vllm:request_success",),
    "time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # vllm:time_per_output_token_seconds: vLLM's earlier name of the same gaps, still emitted
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                    "vllm:time_per_output_token_seconds"),
    "request_time_per_output_token_seconds": ("vllm:request_time_per_output_token_seconds",),
    "e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
    "cache_config_info": ("vllm:cache_config_info",),
}
ROUTER_NAMES = {name: VLLM_NAMES[name] for name in (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "cache_config_info")}
"""What the Gateway API Inference Extension's endpoint picker and the KV-aware routers read:
exposed with or without ``--metrics-compat``."""
LABEL_NAMES = {"num_blocks": "num_gpu_blocks"}  # cache_config_info: our label -> vLLM's


class VllmNames:
    """A Prometheus collector yielding, at each scrape, the ``source`` registry's metrics of
    ``names`` (default :data:`VLLM_NAMES`) renamed, with ``engine`` added and labels renamed by
    :data:`LABEL_NAMES`."""

    def __init__(self, source: CollectorRegistry, prefix: str,
                 names: dict[str, tuple[str, ...]] = VLLM_NAMES) -> None:
        self.source, self.prefix, self.names = source, prefix, names

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            for name in self.names.get(family.name.removeprefix(self.prefix), ()):
                renamed = Metric(name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    labels = {LABEL_NAMES.get(k, k): v for k, v in s.labels.items()}
                    renamed.add_sample(name + s.name[len(family.name):],
                                       {**labels, "engine": VLLM_ENGINE}, s.value, s.timestamp,
                                       s.exemplar)
                yield renamed


def vllm_registry(source: CollectorRegistry, prefix: str,
                  names: dict[str, tuple[str, ...]] = VLLM_NAMES) -> CollectorRegistry:
    """A registry holding only the :class:`VllmNames` view of ``source``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VllmNames(source, prefix, names))
    return registry
