"""Per-request accounting: metrics, KV alerts and the log lines, fed by the engine thread.

For every request the engine thread reports each step's output here, with the request's
``RequestTrack`` (kept by the engine loop in its one per-request entry, so the observer holds no
table of its own). The observer turns them
into Prometheus samples (TTFT at the first token, ITL between two output steps, queue time, E2E
latency, TPOT and the request's peak KV bytes at finish) and into log lines, vLLM-style:

- one ``request finished`` line per request (id, prompt/output tokens, TTFT, TPOT, peak KV
  bytes, speculative tokens proposed and accepted, finish reason);
- one ``kv_alert`` warning the first time a request's KV passes ``kv_alert_bytes`` (seed §5.3:
  monitor per-request KV, alert on the abnormal one);
- a periodic ``engine`` line (running, waiting, KV usage, prefix-cache hit rate, throughput).

Times are ``time.perf_counter()`` seconds, the engine's clock. Only the engine thread calls in.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvledger.engine.output.request_output import RequestOutput
from kvledger.server.metrics.server_metrics import ServerMetrics

log = logging.getLogger("kvledger.server")


@dataclass(slots=True)
class RequestTrack:
    """What the observer remembers about one live request (owned by the engine loop's entry)."""

    request_id: str
    arrival: float
    last_token_time: float | None = None
    last: RequestOutput | None = None
    alerted: bool = False


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


class RequestObserver:
    """Records metrics and logs for requests as the engine reports them."""

    def __init__(self, metrics: ServerMetrics, kv_alert_bytes: int | None = None,
                 log_interval_s: float = 10.0) -> None:
        self.metrics = metrics
        self.kv_alert_bytes = kv_alert_bytes
        self.log_interval_s = log_interval_s
        self._totals = {"prompt": 0, "generation": 0}
        self._last_log = (time.perf_counter(), 0, 0)  # time, prompt total, generation total

    def on_added(self, request_id: str) -> RequestTrack:
        """The engine accepted the request; the caller keeps the returned track."""
        return RequestTrack(request_id, arrival=time.perf_counter())

    def on_quota_rejected(self) -> None:
        """A request was refused because its KV can never fit its quota or the pool."""
        self.metrics.counters["kv_quota_rejections"].inc()

    def on_output(self, track: RequestTrack, out: RequestOutput, now: float) -> None:
        """One step's progress of a tracked request (finished ones are closed here)."""
        track.last = out
        n_new = len(out.new_token_ids)
        if n_new:
            self._count_tokens(out, track, n_new, now)
        self._check_kv_alert(out, track)
        if out.finished:
            self._finish(track, out.finish_reason or "stop", now)

    def on_aborted(self, track: RequestTrack) -> None:
        """The server aborted the request (client gone); it counts as ``abort``."""
        self._finish(track, "abort", time.perf_counter())

    def _count_tokens(self, out: RequestOutput, track: RequestTrack, n_new: int, now: float) -> None:
        m, h = self.metrics, self.metrics.histograms
        m.counters["generation_tokens"].inc(n_new)
        self._totals["generation"] += n_new
        if track.last_token_time is None:
            prompt_tokens = out.metrics.num_prompt_tokens or len(out.prompt_token_ids)
            m.counters["prompt_tokens"].inc(prompt_tokens)
            self._totals["prompt"] += prompt_tokens
            ttft = out.metrics.ttft_s
            h["time_to_first_token_seconds"].observe(now - track.arrival if ttft is None else ttft)
            if out.metrics.queue_time_s is not None:
                h["request_queue_time_seconds"].observe(out.metrics.queue_time_s)
        else:
            h["inter_token_latency_seconds"].observe(now - track.last_token_time)
        track.last_token_time = now

    def _check_kv_alert(self, out: RequestOutput, track: RequestTrack) -> None:
        limit = self.kv_alert_bytes
        kv = out.metrics.peak_kv_bytes
        if limit is None or track.alerted or kv <= limit:
            return
        track.alerted = True
        self.metrics.counters["kv_alerts"].inc()
        log.warning(
            "kv_alert request_id=%s prompt_tokens=%d output_tokens=%d kv_bytes=%d "
            "threshold_bytes=%d", out.request_id, len(out.prompt_token_ids),
            len(out.token_ids), kv, limit,
        )

    def _finish(self, track: RequestTrack, reason: str, now: float) -> None:
        request_id, out = track.request_id, track.last
        self.metrics.count_finished(reason)
        self.metrics.histograms["e2e_request_latency_seconds"].observe(now - track.arrival)
        peak = out.metrics.peak_kv_bytes if out else 0
        if out is not None and out.tpot_s is not None:
            self.metrics.histograms["request_time_per_output_token_seconds"].observe(out.tpot_s)
        self.metrics.histograms["request_kv_bytes"].observe(peak)
        log.info(
            "request finished id=%s prompt_tokens=%d output_tokens=%d ttft_s=%s tpot_s=%s "
            "peak_kv_bytes=%d spec_proposed=%d spec_accepted=%d finish_reason=%s%s", request_id,
            len(out.prompt_token_ids) if out else 0, len(out.token_ids) if out else 0,
            _fmt_s(out.metrics.ttft_s if out else None), _fmt_s(out.tpot_s if out else None),
            peak, out.metrics.spec_proposed_tokens if out else 0,
            out.metrics.spec_accepted_tokens if out else 0,
            reason, f" error={out.error!r}" if out and out.error else "",
        )

    def on_stats(self, stats: dict, now: float, force_log: bool = False) -> None:
        """Engine-wide figures after a step: gauges, counters, and the periodic engine line."""
        self.metrics.update_from_stats(stats)
        t0, p0, g0 = self._last_log
        elapsed = now - t0
        if elapsed < self.log_interval_s and not force_log:
            return
        prompt, gen = self._totals["prompt"], self._totals["generation"]
        busy = stats.get("num_running", 0) or stats.get("num_waiting", 0)
        if prompt == p0 and gen == g0 and not busy:
            return
        queried = stats.get("prefix_cache_queried_tokens", 0)
        hit_rate = stats.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0
        log.info(
            "engine running=%d waiting=%d kv_usage=%.1f%% prefix_hit_rate=%.1f%% "
            "prompt_throughput=%.1f tok/s generation_throughput=%.1f tok/s preemptions=%d",
            stats.get("num_running", 0), stats.get("num_waiting", 0),
            100 * stats.get("kv_usage", 0.0), 100 * hit_rate, (prompt - p0) / elapsed,
            (gen - g0) / elapsed, stats.get("num_preemptions", 0),
        )
        self._last_log = (now, prompt, gen)
