"""``kvledger models``: the Hugging Face ids ``kvledger plan`` knows offline (the catalogue)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

WIDE = 120  # columns of the table when stdout is not a terminal


def models(
    kv_dtype: Annotated[str, typer.Option(help="KV format of the bytes-per-token column")] = "bf16",
    json_out: Annotated[bool, typer.Option("--json", help="Print the rows as JSON")] = False,
) -> None:
    """List the shipped model configs: layer kinds, KV heads, head_dim, KV bytes per token."""
    from kvledger.ledger.kv_format import kv_format
    from kvledger.model.catalogue import catalogue_rows

    kv_format(kv_dtype)  # an unknown format is a one-line error before any work
    rows = catalogue_rows(kv_dtype)
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    from kvledger.commands.plan_render import fmt_bytes

    table = Table(title=f"Model catalogue (KV {kv_dtype}); plan one with `kvledger plan ID`",
                  title_justify="left", title_style="bold")
    for i, col in enumerate(("model id", "layer kinds", "KV heads", "head_dim", "KV / token")):
        table.add_column(col, justify="left" if i < 2 else "right", no_wrap=i == 0)
    for r in rows:
        latent = r["mla_latent_dim"]
        heads, dim = ("latent", str(latent)) if latent else (str(r["num_kv_heads"]),
                                                              str(r["head_dim"]))
        table.add_row(r["model_id"], r["layer_kinds"], heads, dim,
                      fmt_bytes(r["kv_bytes_per_token"]))
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, WIDE)  # pipes and files get the whole table
    console.print(table)
