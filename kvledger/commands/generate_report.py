"""Summary of a ``kvledger generate`` run: timings and the KV bill, as a table or JSON.

KV "held" comes from the pool tensors: the request's peak block count times the bytes one
block really occupies (``store.nbytes / num_blocks``). The ledger figure is
``kv_bytes_per_token × tokens`` for the tokens whose K/V were cached (prompt + output − 1: the
last sampled token is never fed back), and the same rounded up to whole blocks; under an
evicting ``--kv-policy`` it is the policy's bound (``RetentionSpec.max_kv_tokens`` /
``max_kv_blocks``), which the held figure never passes. A model with state layers holds one
state slot per sequence beside its blocks: held is one slot of the state tensors
(``StateStore.row_bytes``), the ledger's is ``kv.fixed_state_bytes`` in the compute dtype.
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from kvledger.ledger.admission import kv_tokens_of
from kvledger.ledger.kv import fixed_state_bytes


def request_figures(engine, out) -> dict:
    """Per-request metrics and KV bytes (measured from tensors vs the ledger)."""
    m = out.metrics
    store = engine.store  # None with --no-kv-cache: nothing is held between steps
    block_bytes = store.nbytes // store.num_blocks if store is not None else 0
    blocks = m.peak_kv_bytes // engine.bytes_per_block if store is not None else 0
    prompt, total = len(out.prompt_token_ids), len(out.prompt_token_ids) + len(out.token_ids)
    bs, retention = engine.config.block_size, engine.config.retention
    kv_tokens = kv_tokens_of(total)
    ledger_blocks = -(-kv_tokens // bs)
    if retention.evicts:  # the policy's bound (ledger/retention.py), what admission used
        kv_tokens = retention.max_kv_tokens(prompt, total)
        ledger_blocks = retention.max_kv_blocks(prompt, total, bs)
    tpot = out.tpot_s
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "output_tokens": len(out.token_ids),
        "prefix_cache_hit_tokens": m.num_cached_tokens,
        "ttft_s": m.ttft_s,
        "tpot_s": tpot,
        "decode_tok_s": (1.0 / tpot) if tpot else None,
        "kv_blocks_held": blocks,
        "kv_bytes_held": blocks * block_bytes,
        "kv_tokens": kv_tokens,
        "kv_bytes_ledger": kv_tokens * engine.bytes_per_token,
        "kv_bytes_ledger_blocks": ledger_blocks * engine.bytes_per_block,
        "kv_policy": retention.describe(),
        **_state_figures(engine),
    }


def _state_figures(engine) -> dict:
    """A state model's slot bytes, held (tensors) and the ledger's; nothing without states."""
    states = engine.states
    if states is None:
        return {}
    element = states.conv[0].dtype.itemsize
    return {"state_bytes_held": states.row_bytes,
            "state_bytes_ledger": fixed_state_bytes(engine.spec, element)}


def print_json(engine, results, load_s: float) -> None:
    """One JSON object: text, token ids, finish reason and metrics per request."""
    items = [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
              "error": o.error, "metrics": request_figures(engine, o)} for o in results]
    doc = {"model": engine.model_name, "dtype": engine.config.dtype, "load_s": load_s,
           "kv_format": engine.kv_format, "kv_bytes_per_token": engine.bytes_per_token,
           "kv_pool_bytes": engine.stats()["kv_pool_bytes"]}
    if engine.tokenizer_note:
        doc["tokenizer_note"] = engine.tokenizer_note
    doc.update(items[0] if len(items) == 1 else {"results": items})
    print(json.dumps(doc))


def print_summary(engine, results, load_s: float) -> None:
    """One small rich table per request on stderr (stdout keeps only the generated text)."""
    console = Console(stderr=True)
    formats = engine.model.weight_formats
    packed = (" (weights: " + ", ".join(f"{k} {v}" for k, v in formats.items()) + ")"
              if set(formats.values()) != {"dense"} else "")
    console.print(f"[bold]{engine.model_name}[/bold] · {engine.config.dtype}{packed} · KV "
                  f"{engine.kv_layout.describe()}, {engine.bytes_per_token:,} B/token · load {load_s:.2f} s")
    for i, o in enumerate(results):
        if len(results) > 1:
            print(f"--- [{i}] {o.text}")
        if o.error:
            console.print(f"[red]request {i} failed: {o.error}[/red]")
            continue
        f = request_figures(engine, o)
        table = Table(show_header=False, box=None, padding=(0, 2))
        table.add_column(style="dim")
        table.add_column(justify="right")
        table.add_row("tokens", f"{f['prompt_tokens']} prompt + {f['output_tokens']} output "
                      f"({o.finish_reason})")
        table.add_row("TTFT", _ms(f["ttft_s"]))
        table.add_row("TPOT", _ms(f["tpot_s"]) + (
            f" ({f['decode_tok_s']:.1f} tok/s)" if f["decode_tok_s"] else ""))
        held = (f"{f['kv_bytes_held']:,} B in {f['kv_blocks_held']} blocks of "
                f"{engine.config.block_size} tokens" if engine.store is not None
                else "none: --no-kv-cache recomputes every K/V at every step")
        table.add_row("KV held (tensors)", held)
        if engine.config.retention.evicts:
            table.add_row("KV policy", f"{f['kv_policy']}; the ledger line is its bound")
        table.add_row("KV ledger", f"{f['kv_bytes_ledger']:,} B = {f['kv_tokens']} tokens "
                      f"× {engine.bytes_per_token:,} B ({f['kv_bytes_ledger_blocks']:,} B in "
                      "whole blocks)")
        if "state_bytes_held" in f:
            table.add_row("state held (tensors)", f"{f['state_bytes_held']:,} B in one slot")
            table.add_row("state ledger", f"{f['state_bytes_ledger']:,} B per sequence, "
                          "at every length")
        console.print(table)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
