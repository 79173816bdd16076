"""One ``kvledger bench`` run from options to :class:`BenchResult`.

Order of work: find the model (``/v1/models``) and a token counter (``/tokenize``, else
``--tokenizer``, else an estimate); check ``/metrics``; send warm-up requests (excluded from the
results), which also calibrate the chat template's token overhead from their ``usage``; then run
the workload's levels one after the other with a progress bar; finally detect anomalies and
compute the ledger overlay.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import sys
from collections import Counter
from dataclasses import dataclass

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvledger.bench.anomaly import find_anomalies
from kvledger.bench.client import stream_request
from kvledger.bench.metrics import MetricsWatcher
from kvledger.bench.prompts import TokenCounter, make_counter, make_prompt
from kvledger.bench.records import BenchResult, RequestRecord
from kvledger.bench.runner import LevelRunner
from kvledger.bench.target import BenchTargetError, Target
from kvledger.bench.workloads import WorkloadConfig, make_levels

WARMUP_PROMPT_TOKENS = 32
WARMUP_OUTPUT_TOKENS = 4
APPROX_NOTE = ("no /tokenize on the server and no --tokenizer: prompt lengths are estimates "
               "(4 characters per token); plots use the server's usage.prompt_tokens if reported")


@dataclass
class BenchOptions:
    """The CLI options of ``kvledger bench`` (see kvledger/commands/bench.py for help)."""

    url: str
    api_key: str | None = None
    model: str | None = None
    endpoint: str = "chat"
    workload: str = "sweep"
    prompt_lens: tuple[int, ...] = (2048, 4096, 8192, 16384)
    output_len: int = 128
    concurrency: tuple[int, ...] = (1,)
    requests: int = 4
    request_rate: float | None = None
    seed: int = 0
    tokenizer: str | None = None
    turn_tokens: int = 512
    turns: int = 8
    warmup: int = 2
    timeout_s: float = 600.0


async def _warm_up(opts: BenchOptions, client: httpx.AsyncClient, target: Target,
                   counter: TokenCounter, notes: list[str]) -> int:
    """Send warm-up requests; return the server's prompt-token overhead over our count.

    Raises:
        BenchTargetError: every warm-up request failed (the server cannot generate).
    """
    text, count = make_prompt(counter, "warmup", WARMUP_PROMPT_TOKENS)
    overheads, errors = [], []
    for _ in range(max(1, opts.warmup)):
        result = await stream_request(client, target.generate_url,
                                      target.payload(text, WARMUP_OUTPUT_TOKENS), target.headers)
        if not result.ok:
            errors.append(result.error)
        elif result.prompt_tokens is not None:
            overheads.append(result.prompt_tokens - count)
    if len(errors) == max(1, opts.warmup):
        raise BenchTargetError(f"warm-up request to {target.generate_url} failed: {errors[0]}")
    if not overheads:
        notes.append("the server reports no usage.prompt_tokens: prompt lengths are ours only")
        return 0
    overhead = min(overheads)
    if overhead and counter.exact:
        notes.append(f"the server adds {overhead} token(s) around a prompt (chat template, "
                     "BOS); sweep prompts are shortened by that much")
    return max(0, overhead) if counter.exact else 0


def _request_notes(records: list[RequestRecord], summaries: list[dict]) -> list[str]:
    """Per-request notes grouped by text, and one failure line per level with failures."""
    grouped = Counter(note for r in records for note in r.notes)
    notes = [f"{n} request(s): {text}" for text, n in grouped.most_common()]
    for s in summaries:
        if s["failures"]:
            first = next(r.error for r in records if r.level == s["level"] and not r.ok)
            notes.append(f"{s['level']}: {s['failures']} failure(s), first: {first}")
    return notes


def _meta(opts: BenchOptions, target: Target, counter: TokenCounter, overhead: int,
          metrics: bool) -> dict:
    return {
        "command": " ".join(["kvledger", *sys.argv[1:]]) if sys.argv else "",
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": f"{platform.machine()} {platform.processor() or ''} "
                f"{os.cpu_count()} CPUs, {platform.system()}".replace("  ", " "),
        "url": target.base_url, "model": target.model, "endpoint": target.endpoint,
        "workload": opts.workload, "prompt_lens": list(opts.prompt_lens),
        "output_len": opts.output_len, "concurrency": list(opts.concurrency),
        "requests_per_level": opts.requests, "request_rate": opts.request_rate,
        "seed": opts.seed, "token_counts": counter.source,
        "max_model_len": target.max_model_len, "template_overhead_tokens": overhead,
        "server_metrics": metrics,
    }


async def _run(opts: BenchOptions, console: Console, sync_client: httpx.Client) -> BenchResult:
    target = Target.from_url(opts.url, opts.api_key, opts.endpoint)
    target.discover(sync_client, opts.model)
    counter = make_counter(sync_client, target, opts.tokenizer)
    target.max_model_len = target.max_model_len or counter.max_model_len
    notes = [] if counter.exact else [APPROX_NOTE]
    limits = httpx.Limits(max_connections=max(opts.concurrency) + 4)
    timeout = httpx.Timeout(opts.timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        metrics = await MetricsWatcher(client, target).scrape() is not None
        if not metrics:
            notes.append("the server exposes no Prometheus /metrics: anomalies are not explained")
        overhead = await _warm_up(opts, client, target, counter, notes)
        cfg = WorkloadConfig(list(opts.prompt_lens), opts.output_len, list(opts.concurrency),
                             opts.requests, opts.turn_tokens, opts.turns, target.max_model_len,
                             overhead)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("building prompts", total=0)
            runner = LevelRunner(client, target, opts.output_len, opts.request_rate, opts.seed,
                                 metrics, on_done=lambda r: progress.advance(task),
                                 exact_counts=counter.exact)
            records, summaries = await _levels(opts, cfg, counter, target, runner, progress, task)
            progress.update(task, description="done")
    anomalies, anomaly_notes = find_anomalies(summaries)
    return BenchResult(
        meta=_meta(opts, target, counter, overhead, metrics), summaries=summaries,
        records=records, anomalies=anomalies,
        notes=notes + cfg.notes + anomaly_notes + _request_notes(records, summaries),
    )


async def _levels(opts, cfg, counter, target, runner, progress, task):
    """Drive the workload generator: run each level, send its records back for the next."""
    records: list[RequestRecord] = []
    summaries: list[dict] = []
    levels = make_levels(opts.workload, cfg, counter, target.endpoint == "chat")
    level, total = next(levels, None), 0
    while level is not None:
        total += len(level.specs)
        progress.update(task, total=total, description=level.label)
        level_records, summary = await runner.run(level)
        records += level_records
        summaries.append(summary)
        progress.update(task, description="building prompts")
        try:
            level = levels.send(level_records)
        except StopIteration:
            level = None
    return records, summaries


def run_bench(opts: BenchOptions, console: Console | None = None) -> BenchResult:
    """Run the benchmark described by ``opts`` against its server.

    Raises:
        BenchTargetError: the server is unreachable, lists no model, or cannot generate.
    """
    console = console or Console(stderr=True)
    with httpx.Client(timeout=httpx.Timeout(opts.timeout_s, connect=10.0)) as sync_client:
        return asyncio.run(_run(opts, console, sync_client))
