"""Send one level's requests: arrivals, the client's concurrency slots, server metrics.

Arrivals: all at the level's start (closed loop), or a Poisson process of ``request_rate``
requests per second (exponential gaps, seeded, so a run is reproducible). Each arrived request
waits for one of ``concurrency`` slots (an ``asyncio.Semaphore``); that wait is recorded as
``slot_wait_s`` and is *not* part of TTFT, which starts when the request is sent. A level with
``cold_first`` sends its first request alone, then the others.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import httpx

from kvledger.bench.client import stream_request
from kvledger.bench.metrics import MetricsWatcher
from kvledger.bench.records import Level, RequestRecord, RequestSpec
from kvledger.bench.stats import summarize_level
from kvledger.bench.target import Target


def arrival_offsets(n: int, request_rate: float | None, rng: random.Random) -> list[float]:
    """Arrival times (s from the start) of ``n`` requests: all 0, or Poisson at ``rate``/s."""
    if not request_rate:
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


class LevelRunner:
    """Runs levels against one target with one shared httpx client."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        target: Target,
        output_len: int,
        request_rate: float | None = None,
        seed: int = 0,
        watch_metrics: bool = True,
        on_done: Callable[[RequestRecord], None] | None = None,
        exact_counts: bool = True,
    ) -> None:
        """``exact_counts``: prompt token counts are the server's own (a mismatch is noted)."""
        self.client, self.target, self.output_len = client, target, output_len
        self.request_rate = request_rate
        self.rng = random.Random(seed)
        self.watch_metrics = watch_metrics
        self.on_done = on_done or (lambda record: None)
        self.exact_counts = exact_counts

    async def run(self, level: Level) -> tuple[list[RequestRecord], dict]:
        """Send every request of ``level``; return its records (by index) and summary."""
        watcher = MetricsWatcher(self.client, self.target)
        if self.watch_metrics:
            await watcher.start()
        slots = asyncio.Semaphore(level.concurrency)
        start = time.perf_counter()
        indexed = list(enumerate(level.specs))
        records: list[RequestRecord] = []
        if level.cold_first and indexed:
            records.append(await self._one(level, *indexed.pop(0), 0.0, start, slots))
        offset = time.perf_counter() - start
        arrivals = arrival_offsets(len(indexed), self.request_rate, self.rng)
        records += await asyncio.gather(*(
            self._one(level, i, spec, offset + at, start, slots)
            for (i, spec), at in zip(indexed, arrivals)
        ))
        wall = time.perf_counter() - start
        metrics = await watcher.stop()
        return records, summarize_level(level, records, wall, metrics)

    async def _one(
        self, level: Level, index: int, spec: RequestSpec, at: float, start: float,
        slots: asyncio.Semaphore,
    ) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        arrival = time.perf_counter() - start
        async with slots:
            send = time.perf_counter() - start
            result = await stream_request(
                self.client, self.target.generate_url,
                self.target.payload(spec.prompt, self.output_len), self.target.headers,
            )
        notes = list(result.notes)
        if result.ok and result.output_tokens != self.output_len:
            notes.append(f"server returned {result.output_tokens} output tokens, "
                         f"{self.output_len} requested")
        exact = self.exact_counts and not spec.estimated
        if exact and result.ok and result.prompt_tokens not in (None, spec.prompt_tokens):
            notes.append(f"server counted {result.prompt_tokens} prompt tokens, "
                         f"{spec.prompt_tokens} intended")
        record = RequestRecord(
            level=level.label, workload=level.workload, index=index, uid=spec.uid,
            phase=spec.phase, concurrency=level.concurrency, level_prompt_len=level.prompt_len,
            target_prompt_tokens=spec.prompt_tokens, requested_output_tokens=self.output_len,
            arrival_s=arrival, send_s=send, ok=result.ok, error=result.error,
            ttft_s=result.ttft_s, e2e_s=result.e2e_s, tpot_s=result.tpot_s,
            output_tokens=result.output_tokens, prompt_tokens=result.prompt_tokens,
            content_events=result.content_events, itl_s=result.itl_s, notes=notes,
            turn=level.turn, answer=result.text,
        )
        self.on_done(record)
        return record
