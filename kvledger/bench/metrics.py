"""Server-side evidence for each level: scrape Prometheus ``/metrics`` around and during it.

A jump in TTFT or TPOT means little without the server's view of memory. When the server
exposes ``/metrics`` (Prometheus text format), the bench scrapes it before a level, every
``interval`` seconds while the level runs (gauges are instantaneous, so their peak is only seen
while requests are in flight) and after it. Counters give deltas, gauges give peaks.

Metric names differ by server; each family lists the base names it accepts (the part after the
``namespace:`` prefix, so ``vllm:``, ``kvledger:``, ``sglang:`` and ``llamacpp:`` all match):

- preemptions (counter): ``num_preemptions_total`` (vLLM, kvledger), ``num_preemptions``;
- KV usage (gauge, fraction 0-1): ``kv_cache_usage_perc`` (vLLM >= 0.10, kvledger),
  ``gpu_cache_usage_perc`` (older vLLM), ``token_usage`` (SGLang), ``kv_cache_usage_ratio``
  (llama.cpp);
- queue (gauge): ``num_requests_waiting``, ``num_queue_reqs``, ``requests_deferred``;
- running (gauge): ``num_requests_running``, ``num_running_reqs``, ``requests_processing``;
- prefix cache (counters, tokens): ``prefix_cache_hits_total`` / ``prefix_cache_queries_total``.

A server may export one family under several label sets (one per engine, model or reason).
Counters and the request-count gauges are summed over them; KV usage, a fraction of each
engine's own pool, takes the largest (a sum of two pools' 0.6 would read as 1.2).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import httpx

from kvledger.bench.target import Target

COUNTERS = {
    "preemptions": ("num_preemptions_total", "num_preemptions"),
    "prefix_hits": ("prefix_cache_hits_total", "prefix_cache_hits"),
    "prefix_queries": ("prefix_cache_queries_total", "prefix_cache_queries"),
}
GAUGES = {
    "kv_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc", "token_usage",
                 "kv_cache_usage_ratio"),
    "waiting": ("num_requests_waiting", "num_queue_reqs", "requests_deferred"),
    "running": ("num_requests_running", "num_running_reqs", "requests_processing"),
}


FRACTIONS = frozenset({"kv_usage"})  # gauges that combine by max over label sets


def parse_exposition(text: str) -> dict[str, list[float]]:
    """Prometheus text format -> {metric name: its values, one per label set}."""
    samples: dict[str, list[float]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[: line.index("{")], line[line.rindex("}") + 1 :]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        samples.setdefault(name, []).append(value)
    return samples


def family(samples: dict[str, list[float]], names: tuple[str, ...],
           combine=sum) -> float | None:
    """``combine`` (sum, or max for a fraction) of the samples whose base name (after any
    ``namespace:``) is one of ``names``; None when there is none."""
    hits = [v for k, vs in samples.items() if k.rpartition(":")[2] in names for v in vs]
    return combine(hits) if hits else None


@dataclass
class LevelMetrics:
    """Server metrics over one level. None where the server does not expose that family."""

    available: bool = False
    scrapes: int = 0
    preemptions: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    kv_usage_peak: float | None = None  # fraction 0-1
    waiting_peak: float | None = None
    running_peak: float | None = None

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prefix-cache hit tokens / queried tokens during the level."""
        if not self.prefix_queries or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_queries


class MetricsWatcher:
    """Scrapes ``/metrics`` before, during (every ``interval`` s) and after one level."""

    def __init__(self, client: httpx.AsyncClient, target: Target, interval: float = 0.5) -> None:
        self.client, self.target, self.interval = client, target, interval
        self._first: dict[str, float] | None = None
        self._peaks: dict[str, float] = {}
        self._scrapes = 0
        self._task: asyncio.Task | None = None

    async def scrape(self) -> dict[str, float] | None:
        """One scrape; None when the server has no usable /metrics."""
        try:
            response = await self.client.get(
                f"{self.target.base_url}/metrics", headers=self.target.headers
            )
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        samples = parse_exposition(response.text)
        known = [*COUNTERS.values(), *GAUGES.values()]
        if not any(family(samples, names) is not None for names in known):
            return None
        self._scrapes += 1
        for key, names in GAUGES.items():
            value = family(samples, names, max if key in FRACTIONS else sum)
            if value is not None:
                self._peaks[key] = max(value, self._peaks.get(key, value))
        return samples

    async def start(self) -> None:
        """Take the 'before' scrape and start polling gauges if the server has /metrics."""
        self._first = await self.scrape()
        if self._first is not None:
            self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.scrape()

    async def stop(self) -> LevelMetrics:
        """Stop polling, take the 'after' scrape, return counter deltas and gauge peaks."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._first is None:
            return LevelMetrics()
        last = await self.scrape() or self._first
        result = LevelMetrics(available=True, scrapes=self._scrapes)
        for key, names in COUNTERS.items():
            before, after = family(self._first, names), family(last, names)
            if before is not None and after is not None:
                setattr(result, key, after - before)
        result.kv_usage_peak = self._peaks.get("kv_usage")
        result.waiting_peak = self._peaks.get("waiting")
        result.running_peak = self._peaks.get("running")
        return result
