"""Rich tables for ``kvledger plan``: one table per question of the seed's cost template.

Bytes print in binary units (KiB, MiB, GiB, as the seed's §2.2 figures are), times in ms or s.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvledger.ledger.draft_plan import DraftPlan
from kvledger.ledger.planner import Plan


def fmt_bytes(n: float) -> str:
    """``524288`` -> ``"512.0 KiB"``; ``2**32`` -> ``"4.00 GiB"``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit in ("GiB", "TiB") else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def fmt_tokens(n: int) -> str:
    """``8192`` -> ``"8K"``; ``20000`` -> ``"20000"`` (K only when exact)."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left", title_style="bold")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    return table


def render(p: Plan, console: Console | None = None) -> None:
    """Print every table of plan ``p``."""
    console = console or Console()
    o, d = p.options, p.device
    console.print(
        f"[bold]{p.model}[/bold] ({p.model_type}): {fmt_count(p.params_total)} params, "
        f"{fmt_count(p.params_active)} active; weights {p.weights_dtype} "
        f"{fmt_bytes(p.weights_bytes)}{' per rank' if o.tp > 1 else ''}\n"
        f"device {d.name}: {d.memory_gib:g} GiB, {d.bandwidth_gbs:g} GB/s, {d.tflops:g} TFLOPS "
        f"(x{o.tp}); KV {o.kv_format}, block {o.block_size} = {fmt_bytes(p.block_bytes)}; "
        f"KV pool {fmt_bytes(p.pool_bytes)} = {p.pool_blocks} blocks "
        f"({o.gpu_util:g} x memory - weights - {o.reserve_gib:g} GiB reserve); longest "
        f"request alone {p.max_request_tokens} tokens"
    )
    kinds = _table(
        "KV per token, by layer kind", "layer kind", "layers", "per layer", "all layers", "window"
    )
    for r in p.layer_kinds:
        kinds.add_row(
            r.kind,
            str(r.layers),
            fmt_bytes(r.bytes_per_token_per_layer),
            fmt_bytes(r.bytes_per_token),
            str(r.window or "-"),
        )
    kinds.add_row("total", "", "", fmt_bytes(p.kv_bytes_per_token), "")
    console.print(kinds)
    if p.state_bytes_per_sequence:
        console.print(f"state per sequence {fmt_bytes(p.state_bytes_per_sequence)} (fixed, "
                      f"every length) beside KV per token {fmt_bytes(p.kv_bytes_per_token)}: "
                      f"a request holds both")
    _contexts(p, console)
    _latency(p, console)
    _tier_crossover(p, console)
    turns = _table("Chat growth by turn", "turn", f"tokens ({o.turn_tokens}/turn)", "KV")
    for t, n, b in p.turns:
        turns.add_row(str(t), str(n), fmt_bytes(b))
    console.print(turns)
    console.print(f"a chat of {o.turn_tokens}-token turns fills the model's context at turn "
                  f"{p.context_full_turn}")
    _formats(p, console)
    _retention(p, console)


def render_draft(d: DraftPlan, console: Console | None = None) -> None:
    """Print the draft model's part of a plan (``--draft-model``)."""
    console = console or Console()
    console.print(
        f"[bold]draft {d.model}[/bold]: {fmt_count(d.params_total)} params, weights "
        f"{fmt_bytes(d.weights_bytes)}, KV bf16 {fmt_bytes(d.kv_bytes_per_token)} per token; "
        f"a block of both {fmt_bytes(d.block_bytes)}; KV pool {fmt_bytes(d.pool_bytes)} = "
        f"{d.pool_blocks} blocks")
    rows = _table("Concurrency with the draft", "context", "draft KV / request",
                  "max concurrency", "without the draft")
    for r in d.contexts:
        rows.add_row(fmt_tokens(r.context), fmt_bytes(r.draft_kv_bytes_per_sequence),
                     str(r.max_concurrency), str(r.max_concurrency_without_draft))
    console.print(rows)
    verify = _table(f"Draft k tokens and verify them, batch {d.verify_batch} at context "
                    f"{fmt_tokens(d.verify_context)} ({d.step_model})", "k", "step",
                    "plain step", "ratio", "break-even acceptance")
    for v in d.verify:
        verify.add_row(str(v.k), fmt_time(v.step_s), fmt_time(v.plain_step_s),
                       f"{v.step_ratio:.2f}x", f"{v.break_even_acceptance:.2f}")
    console.print(verify)


def _retention(p: Plan, console: Console) -> None:
    if not p.retention:
        return
    table = _table(
        f"KV retention {p.options.retention.describe()}: one request of each context "
        "(paged blocks, as admitted)", "context", "KV tokens held", "blocks", "KV / request",
        "max concurrency", "full: blocks", "full: concurrency")
    for r in p.retention:
        table.add_row(fmt_tokens(r.context), str(r.kv_tokens), str(r.kv_blocks),
                      fmt_bytes(r.kv_bytes), str(r.max_concurrency), str(r.full_kv_blocks),
                      str(r.full_max_concurrency))
    console.print(table)


def _contexts(p: Plan, console: Console) -> None:
    differs = any(r.kv_bytes_full_reservation != r.kv_bytes_per_sequence for r in p.contexts)
    fixed = any(r.fixed_state_bytes for r in p.contexts)
    cols = [
        "context",
        "KV / request" + (", windowed" if p.options.window_aware and differs else ""),
    ]
    cols += ["KV full reservation"] if differs else []
    cols += ["fixed state"] if fixed else []
    batch = p.options.batch
    cols += [f"KV x batch {batch}"] if batch > 1 else []
    cols += [f"weights + KV{' x batch' if batch > 1 else ''}", "max concurrency", "pool / request"]
    shared = p.options.shared_prefix
    cols += [f"with {shared}-token shared prefix"] if shared else []
    table = _table("KV per request beside the weights, and concurrency", *cols)
    for r in p.contexts:
        row = [str(r.context), fmt_bytes(r.kv_bytes_per_sequence)]
        row += [fmt_bytes(r.kv_bytes_full_reservation)] if differs else []
        row += [fmt_bytes(r.fixed_state_bytes)] if fixed else []
        row += [fmt_bytes(r.kv_bytes_batch)] if batch > 1 else []
        row += [
            fmt_bytes(p.weights_bytes + r.kv_bytes_batch),
            str(r.max_concurrency),
            f"{r.concurrency_ratio:.2f}x",
        ]
        row += [str(r.shared_prefix_concurrency)] if shared else []
        table.add_row(*row)
    console.print(table)


def _latency(p: Plan, console: Console) -> None:
    o = p.options
    table = _table(
        "Prefill (TTFT) and decode (TPOT) bounds",
        "context",
        "prefill FLOPs",
        f"TTFT @ MFU {o.mfu:g}",
        "TTFT floor (MFU 1)",
        f"TPOT floor, batch {o.batch}",
    )
    for r in p.contexts:
        table.add_row(
            str(r.context),
            f"{r.prefill_flops / 1e12:.1f} T",
            fmt_time(r.ttft_s),
            fmt_time(r.ttft_floor_s),
            fmt_time(r.tpot_floor_s),
        )
    console.print(table)


def _tier_crossover(p: Plan, console: Console) -> None:
    c = p.tier_crossover
    if c is None:
        return
    speed = (f"{c.read.bytes_per_s / 1e9:g} GB/s"
             + (f" + {c.read.file_s * 1e6:.0f} µs per file" if c.read.file_s else ""))
    prefill = f"{c.flops_per_s / 1e12:.3g} TFLOP/s (peak x MFU {p.options.mfu:g})"
    if c.tokens is None:
        console.print(f"Disk KV tier at {speed}: recomputing a prefix at {prefill} beats "
                      f"loading it up to the model's context ({c.max_tokens} tokens)")
    else:
        console.print(f"Disk KV tier at {speed}: loading a prefix beats recomputing it at "
                      f"{prefill} from {c.tokens} tokens ({fmt_bytes(c.bytes)}) on")


def _formats(p: Plan, console: Console) -> None:
    ns = [r.context for r in p.contexts]
    cols = ["KV format", "KV / token"]
    cols += [f"KV @ {fmt_tokens(n)}" for n in ns] + [f"conc. @ {fmt_tokens(n)}" for n in ns]
    table = _table("What if the KV were stored in another format", *cols)
    for f in p.formats:
        name = f"{f.kv_format} *" if f.kv_format == p.options.kv_format else f.kv_format
        table.add_row(
            name,
            fmt_bytes(f.kv_bytes_per_token),
            *[fmt_bytes(b) for b in f.kv_bytes_per_sequence],
            *[str(c) for c in f.max_concurrency],
        )
    console.print(table)
