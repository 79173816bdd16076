"""``kvledger bench``: TTFT/TPOT/ITL curves against any OpenAI-compatible server (seed §5.1).

Talks HTTP only (streaming SSE through httpx), so it measures ``kvledger serve``, vLLM, SGLang
or llama.cpp's server alike. Writes results.json, results.csv, PNG plots and report.html into
``--out`` and prints a summary table, the anomalies and the ledger overlay.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from kvledger.errors import KVLedgerError


def _ints(text: str, option: str) -> tuple[int, ...]:
    """Parse ``"2048,4096"`` (``4k`` and ``8K`` allowed) into positive ints."""
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            value = int(float(part[:-1]) * 1024) if part.endswith("k") else int(part)
        except ValueError:
            raise KVLedgerError(f"{option} takes comma-separated integers, got {text!r}") from None
        if value <= 0:
            raise KVLedgerError(f"{option} values must be positive, got {value}")
        values.append(value)
    if not values:
        raise KVLedgerError(f"{option} is empty")
    return tuple(values)


def bench(
    url: Annotated[str, typer.Option(
        help="Server base URL, e.g. http://127.0.0.1:8000 (/v1 optional).")],
    api_key: Annotated[str | None, typer.Option(help="Bearer token (default: $OPENAI_API_KEY).")]
    = None,
    model: Annotated[str | None, typer.Option(
        help="Model name (default: the first of /v1/models).")] = None,
    endpoint: Annotated[str, typer.Option(
        help="chat (/v1/chat/completions) or completions (/v1/completions).")] = "chat",
    workload: Annotated[str, typer.Option(help="sweep | shared-prefix | chat-growth.")] = "sweep",
    prompt_lens: Annotated[str, typer.Option(
        help="Prompt lengths in tokens (shared-prefix: prefix lengths).")]
    = "2048,4096,8192,16384",
    output_len: Annotated[int, typer.Option(
        help="Output tokens per request (max_tokens + ignore_eos).")] = 128,
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, e.g. 1,4,16.")] = "1",
    requests: Annotated[int, typer.Option(
        help="Requests per level (at least the concurrency).")] = 4,
    request_rate: Annotated[float | None, typer.Option(
        help="Poisson arrivals per second (default: all at once).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the Poisson arrivals.")] = 0,
    out: Annotated[str, typer.Option(help="Output folder.")] = "bench-out",
    tokenizer: Annotated[str | None, typer.Option(
        help="Local tokenizer (folder or .gguf) when the server has no /tokenize.")] = None,
    turn_tokens: Annotated[int, typer.Option(
        help="New user tokens per chat turn and per shared-prefix question.")] = 512,
    turns: Annotated[int, typer.Option(help="Turns of the chat-growth workload.")] = 8,
    warmup: Annotated[int, typer.Option(
        help="Warm-up requests, not measured (at least 1: it also measures the prompt "
             "template's token overhead).")] = 2,
    timeout: Annotated[float, typer.Option(help="Per-request timeout in seconds.")] = 600.0,
    plan_model: Annotated[str | None, typer.Option(
        help="Model for the ledger overlay (config.json, GGUF or 'default').")] = None,
    device: Annotated[str | None, typer.Option(
        help="Device for the ledger overlay (a `kvledger plan` device, or 'local').")] = None,
    plan_dtype: Annotated[str | None, typer.Option(
        help="Weights and KV dtype the server runs, for the overlay (e.g. fp32).")] = None,
    api: Annotated[str, typer.Option(
        help="chat (history resent by the client) or responses (history kept by the server, "
             "chat-growth only).")] = "chat",
    memory: Annotated[str, typer.Option(
        help="--api responses: memory policies to run, comma list of full, summary, segment, "
             "window.")] = "full",
    recall: Annotated[bool, typer.Option(
        help="--api responses: plant 10 facts, pad with --turns turns, ask them back.")]
    = False,
    trace: Annotated[str | None, typer.Option(
        help="Also write what was sent as a trace (JSON lines) for `kvledger replay`.")] = None,
) -> None:
    """Measure TTFT, TPOT, ITL and throughput; detect jumps; compare with the ledger."""
    from rich.console import Console
    from rich.table import Table

    from kvledger.bench.overlay import apply_overlay
    from kvledger.bench.report import phase_lines, table, write_all
    from kvledger.bench.session import BenchOptions, run_bench
    from kvledger.bench.workloads import WORKLOADS

    if api not in ("chat", "responses"):
        raise KVLedgerError(f"--api must be chat or responses, not {api!r}")
    if api == "responses":
        if workload != "chat-growth":
            raise KVLedgerError("--api responses runs only --workload chat-growth")
        from kvledger.bench.responses_chat import run_cli

        run_cli(url, api_key or os.environ.get("OPENAI_API_KEY"), memory, turns, turn_tokens,
                output_len, recall, Path(out), Console(width=160))
        return
    if workload not in WORKLOADS:
        raise KVLedgerError(f"--workload must be one of {', '.join(WORKLOADS)}, not {workload!r}")
    if output_len < 1 or requests < 1 or turn_tokens < 1 or turns < 1:
        raise KVLedgerError("--output-len, --requests, --turn-tokens and --turns must be >= 1")
    if request_rate is not None and request_rate <= 0:
        raise KVLedgerError("--request-rate must be > 0 requests per second")
    if (plan_model is None) != (device is None):
        raise KVLedgerError("the ledger overlay needs both --plan-model and --device")
    opts = BenchOptions(
        url=url, api_key=api_key or os.environ.get("OPENAI_API_KEY"), model=model,
        endpoint=endpoint, workload=workload, prompt_lens=_ints(prompt_lens, "--prompt-lens"),
        output_len=output_len, concurrency=_ints(concurrency, "--concurrency"),
        requests=requests, request_rate=request_rate, seed=seed, tokenizer=tokenizer,
        turn_tokens=turn_tokens, turns=turns, warmup=warmup, timeout_s=timeout,
    )
    console = Console() if sys.stdout.isatty() else Console(width=160)
    result = run_bench(opts, console)
    if not result.summaries:
        raise KVLedgerError("no level ran: " + "; ".join(result.notes or ["no level to run"]))
    if plan_model is not None:
        apply_overlay(result, plan_model, device, plan_dtype)
    headers, rows = table(result.summaries, compact=True)
    grid = Table(title=f"kvledger bench: {result.meta['model']} at {result.meta['url']}")
    for header in headers:
        grid.add_column(header, no_wrap=header == "level")
    for row in rows:
        grid.add_row(*row)
    console.print(grid)
    for line in phase_lines(result.summaries):
        console.print(line)
    for anomaly in result.anomalies:
        console.print(f"[bold red]anomaly:[/] {anomaly.message()}")
    if result.overlay:
        console.print(f"ledger overlay, measured / floor ({result.overlay['title']}):")
        ratios: dict[str, list[str]] = {}
        for r in result.overlay["rows"]:
            ratios.setdefault(r["level"], []).append(f"{r['metric']} {r['ratio']:.2f}")
        for level, parts in ratios.items():
            console.print(f"  {level}: {', '.join(parts)}")
    for note in result.notes:
        console.print(f"note: {note}")
    for path in write_all(result, Path(out)):
        console.print(f"wrote {path}")
    if trace is not None:
        from kvledger.replay.bench_trace import write_bench_trace

        write_bench_trace(result, trace)
        console.print(f"wrote {trace}")
