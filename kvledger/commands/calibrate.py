"""``kvledger calibrate``: K/V channel magnitudes per layer and KV head on real text, the fp16
outlier channels they pick, the error a quantized format makes there, and a calibration file
for ``--kv-calibration``. The work is in :mod:`kvledger.eval.calibrate`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer

from kvledger.errors import InvalidParameterError

Opt = typer.Option


def calibrate(
    model: Annotated[str, Opt(help="default (the bundled model), a GGUF file or an HF folder")] = "default",
    text: Annotated[Path | None, Opt(help="UTF-8 text file (default: Python's pydoc_data.topics)")] = None,
    kv_cache_dtype: Annotated[str, Opt(help="Quantized KV format to measure: fp8, int8, int4")] = "int4",
    kv_group_size: Annotated[int | None, Opt(help="int8/int4 group along head_dim")] = None,
    kv_key_quant: Annotated[str, Opt(help="per-channel or per-token keys")] = "per-channel",
    kv_outlier_channels: Annotated[int, Opt(help="fp16 key channels per layer and KV head")] = 4,
    kv_rotation: Annotated[str, Opt(
        help="none or hadamard: calibrate in the rotated basis (the file records it)")] = "none",
    context: Annotated[int, Opt(help="Tokens per chunk")] = 512,
    chunks: Annotated[int, Opt(help="Chunks of text to run")] = 4,
    out: Annotated[Path | None, Opt(help="Calibration file (default: <model>.kv-calibration.json)")] = None,
    plot: Annotated[Path | None, Opt(help="PNG heatmap of the error by layer x KV head")] = None,
    json_out: Annotated[bool, Opt("--json", help="Print one JSON object instead of tables")] = False,
) -> None:
    """Calibrate quantized KV on real text: magnitudes, outlier channels, errors, a file."""
    from kvledger.engine.config import EngineConfig
    from kvledger.eval.calibrate import calibrate as run
    from kvledger.eval.calibrate import write_heatmap
    from kvledger.eval.corpus import read_text
    from kvledger.eval.perplexity import check_protocol, chunk_tokens, perplexity
    from kvledger.eval.scoring import load_engines
    from kvledger.ledger.kv_format import kv_format

    if not kv_format(kv_cache_dtype).quantized:
        raise InvalidParameterError(
            f"--kv-cache-dtype must be a quantized format (fp8, int8, int4), got {kv_cache_dtype}")
    check_protocol(context, None)
    body, name = read_text(text)
    engine, _ = load_engines(EngineConfig(model=model, kv_cache_dtype="fp32"), context)
    measured = dataclasses.replace(engine.config, kv_cache_dtype=kv_cache_dtype,
                                   kv_group_size=kv_group_size, kv_key_quant=kv_key_quant,
                                   kv_outlier_channels=kv_outlier_channels,
                                   kv_rotation=kv_rotation)
    ids = engine.tokenizer.encode(body, add_special_tokens=False)
    runs = chunk_tokens(ids, context, chunks)
    cal = run(engine, runs, measured.kv_format_spec())
    out = out or Path(f"{engine.model_name}.kv-calibration.json")
    cal.write(out, name)
    quantized = _engine_like(engine, dataclasses.replace(measured, kv_calibration=str(out)))
    score = perplexity(quantized, ids, context, max_chunks=chunks, base=engine)
    cal.kld_mean, cal.delta_ppl_pct = score.kld_mean, score.delta_ppl_pct
    cal.write(out, name)
    if plot is not None:
        write_heatmap(cal, plot)
    if json_out:
        print(json.dumps({**cal.to_json(name), "file": str(out)}))
        return
    _print(cal, out, plot)


def _engine_like(engine, cfg):
    """An engine on the same model under ``cfg`` (the quantized format and its calibration)."""
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_weights

    spec, weights = load_weights(cfg.model, engine.model.dtype)
    return LLMEngine(cfg, spec=spec, weights=weights, tokenizer=engine.tokenizer)


def _print(cal, out: Path, plot: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{cal.model} · {cal.kv_format} · relative round-trip error per layer "
                        f"(mean over KV heads) · {cal.tokens} tokens")
    for col in ("layer", "keys", f"keys + {cal.outlier_channels} outliers", "values",
                "largest key channel |K|", "outlier channels (head 0)"):
        table.add_column(col, justify="right")
    for layer in range(cal.key_error.shape[0]):
        table.add_row(str(layer), f"{cal.key_error[layer].mean():.4f}",
                      f"{cal.key_error_outliers[layer].mean():.4f}",
                      f"{cal.value_error[layer].mean():.4f}",
                      f"{cal.key_absmax[layer].max():.1f}",
                      " ".join(map(str, cal.outliers[layer, 0].tolist())))
    console = Console()
    console.print(table)
    console.print(f"next-token KL divergence vs full-precision KV: {cal.kld_mean:.5f} "
                  f"(ΔPPL {cal.delta_ppl_pct:+.3f} %) · calibration file: {out}"
                  + (f" · heatmap: {plot}" if plot else ""))
