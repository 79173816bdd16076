"""``kvledger eval perplexity|passkey``: the quality a KV choice costs, measured on text.

Both take every engine option (``--kv-cache-dtype``, ``--kv-group-size``, ...), print a rich
table or, with ``--json``, one JSON object. The work is in :mod:`kvledger.eval`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kvledger.commands.engine_options import engine_options
from kvledger.engine.config import EngineConfig
from kvledger.errors import InvalidParameterError

Opt = typer.Option


@engine_options()
def perplexity(
    text: Annotated[Path | None, Opt(help="UTF-8 text file (default: Python's pydoc_data.topics)")] = None,
    context: Annotated[int, Opt(help="Chunk length in tokens; the second half is scored")] = 512,
    stride: Annotated[int | None, Opt(
        help="Tokens fed per step (default: the prefill chunk, --max-num-batched-tokens, as "
             "generate and serve feed a prompt; 1 = decode)")] = None,
    chunks: Annotated[int | None, Opt(help="Most chunks to run (default: all)")] = None,
    kl_divergence: Annotated[bool, Opt(
        "--kl-divergence",
        help="Also run a base (fp16 KV, same compute dtype): KLD mean, max, 99.9/99.0 %, "
             "median, top-1 agreement")] = False,
    kl_base: Annotated[str, Opt(
        help="KV format of the base run (fp16 as llama.cpp's f16; auto: the compute dtype)")] = "fp16",
    json_out: Annotated[bool, Opt("--json", help="Print one JSON object instead")] = False,
    *,
    engine_config: EngineConfig,
) -> None:
    """Perplexity on text, llama.cpp's protocol, through the engine's KV cache."""
    from kvledger.eval.corpus import read_text
    from kvledger.eval.perplexity import check_protocol
    from kvledger.eval.perplexity import perplexity as run
    from kvledger.eval.scoring import load_engines

    check_protocol(context, stride)
    body, name = read_text(text)
    engine, base = load_engines(engine_config, context, kl_base if kl_divergence else None)
    ids = engine.tokenizer.encode(body, add_special_tokens=False)
    result = run(engine, ids, context, stride, chunks, base, text=name)
    if json_out:
        print(json.dumps(result.to_json()))
        return
    _print_perplexity(result, engine.config.dtype)


def _print_perplexity(r, compute: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"perplexity · {r.text} · context {r.context}, stride {r.stride}"
                        f" · KV {r.kv_policy}")
    for col in ("KV format", "chunks", "tokens scored", "PPL"):
        table.add_column(col, justify="right")
    row = [r.kv_format, str(r.chunks), str(r.tokens_scored), f"{r.ppl:.4f}"]
    if r.ppl_base is not None:
        for col in (f"PPL ({r.base_kv_format})", "ΔPPL", "same top-1"):
            table.add_column(col, justify="right")
        row += [f"{r.ppl_base:.4f}", f"{r.delta_ppl_pct:+.3f} %",
                f"{100 * r.top1_agreement:.2f} %"]
    table.add_row(*row)
    console.print(table)
    if r.ppl_base is None:
        return
    kld = Table(title=f"KL divergence (nats) against the base: {r.base_kv_format} KV, "
                      f"{compute} compute")
    for col in ("mean", "max", "99.9 %", "99.0 %", "median"):
        kld.add_column(col, justify="right")
    kld.add_row(*(f"{x:.6f}" for x in (r.kld_mean, r.kld_max, r.kld_p999, r.kld_p99,
                                       r.kld_median)))
    console.print(kld)


@engine_options()
def passkey(
    context: Annotated[int, Opt(help="Prompt + answer length in tokens")] = 2048,
    depth: Annotated[str, Opt(
        help="Depths of the key in the filler, comma-separated fractions in [0, 1]")] = "0.5",
    trials: Annotated[int, Opt(help="Keys hidden per depth")] = 1,
    seed: Annotated[int, Opt(help="Seed of the random keys")] = 0,
    json_out: Annotated[bool, Opt("--json", help="Print one JSON object instead")] = False,
    *,
    engine_config: EngineConfig,
) -> None:
    """Pass-key retrieval: a key hidden at each depth of filler text, asked for at the end."""
    from kvledger.eval.passkey import passkey as run
    from kvledger.eval.scoring import load_engines

    depths = _depths(depth)
    if trials < 1:
        raise InvalidParameterError(f"--trials must be >= 1, got {trials}")
    engine, _ = load_engines(engine_config, context)
    result = run(engine, context, depths, trials, seed)
    if json_out:
        print(json.dumps(result.to_json()))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"pass key · context {context} · KV {result.kv_format} · "
                        f"accuracy {100 * result.accuracy:.0f} %")
    for col in ("depth", "key", "answer", "retrieved"):
        table.add_column(col)
    for t in result.trials:
        table.add_row(f"{t.depth:.2f}", t.key, t.answer.strip(), "yes" if t.retrieved else "no")
    Console().print(table)


def _depths(text: str) -> list[float]:
    try:
        depths = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidParameterError(f"--depth must be comma-separated numbers, got {text!r}") from None
    if not depths:
        raise InvalidParameterError("--depth needs at least one value")
    from kvledger.eval.passkey import check_depth

    for d in depths:
        check_depth(d)
    return depths
