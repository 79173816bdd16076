"""Write a bench run to ``--out``: results.json, results.csv, PNG plots, report.html.

``results.json`` holds the metric definitions, run metadata, per-level summaries, every
request record (without generated text), anomalies, notes and the ledger overlay.
``results.csv`` has one row per request. ``report.html`` is self-contained: the plots are
embedded as base64 PNGs, so the file can be mailed or attached to an issue alone.
"""

from __future__ import annotations

import base64
import csv
import html
import json
from dataclasses import asdict
from pathlib import Path

from kvledger.bench import plots
from kvledger.bench.records import BenchResult

DEFINITIONS = {
    "TTFT": "send -> first SSE event carrying generated content (role-only chunks, comments "
            "and keep-alives excluded; time waiting for the client's own concurrency slot "
            "excluded and reported as slot wait)",
    "E2E latency": "send -> last byte of the response (after [DONE]), as vLLM's benchmark",
    "TPOT": "(E2E - TTFT) / (output tokens - k), output tokens from the final usage chunk, k the "
            "tokens delivered with the first content event (from per-chunk usage, "
            "stream_options.continuous_usage_stats, where the server sends it; else 1): tokens "
            "that arrived by TTFT are not divided into TPOT",
    "KV usage peak": "largest /metrics KV-usage sample during the level; with several label "
                     "sets (engines) the largest one, never their sum",
    "ITL": "every gap between consecutive content events, pooled over the level's requests "
           "(an event may carry several tokens, so ITL and TPOT differ)",
    "slot wait": "arrival -> send: time a request waited for the client's concurrency slot",
    "output throughput": "output tokens of successful requests / level wall time",
    "total throughput": "(prompt + output tokens) of successful requests / level wall time",
    "context": "prompt tokens + output tokens / 2: mean KV length during decode (TPOT x axis)",
    "percentiles": "linear interpolation between closest ranks (numpy default); a failed "
                   "request (error, non-200, no content) counts as a failure, never as a zero",
}

NO_ANOMALY = ("no level sits well above its trend (kvledger/bench/anomaly.py: flagged at >= 1.5x "
              "the robust linear trend and >= 3 robust sigmas above it)")
STYLE = ("<style>body{font-family:sans-serif;margin:2em;max-width:1200px}"
         "table{border-collapse:collapse;font-size:13px}"
         "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
         "td:first-child{text-align:left}img{max-width:100%}</style></head><body>")
CSV_FIELDS = ["level", "workload", "index", "uid", "phase", "turn", "concurrency",
              "level_prompt_len", "target_prompt_tokens", "prompt_tokens",
              "requested_output_tokens", "output_tokens", "ok", "error", "arrival_s", "send_s",
              "slot_wait_s", "ttft_s", "tpot_s", "e2e_s", "content_events", "itl_mean_s",
              "notes"]


def _fmt(value, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


COMPACT = ("level", "ok/n", "prompt", "TTFT p50 s", "TTFT p90 s", "TPOT p50 ms", "ITL p50 ms",
           "out tok/s", "KV peak %", "preempt")


def table(summaries: list[dict], compact: bool = False) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the summary table: all columns (HTML) or :data:`COMPACT` ones
    (console)."""
    headers = ["level", "ok/n", "prompt", "TTFT p50 s", "TTFT p90 s", "TTFT p99 s",
               "TPOT p50 ms", "TPOT p90 ms", "ITL p50 ms", "ITL p99 ms", "E2E p50 s",
               "slot wait p50 s",
               "out tok/s", "total tok/s", "KV peak %", "preempt"]
    rows = []
    for s in summaries:
        m = s["metrics"]
        rows.append([
            s["level"], f"{s['requests'] - s['failures']}/{s['requests']}",
            _fmt(s["prompt_tokens_mean"], digits=0),
            _fmt(s["ttft_s"]["p50"]), _fmt(s["ttft_s"]["p90"]), _fmt(s["ttft_s"]["p99"]),
            _fmt(s["tpot_s"]["p50"], 1e3, 1), _fmt(s["tpot_s"]["p90"], 1e3, 1),
            _fmt(s["itl_s"]["p50"], 1e3, 1), _fmt(s["itl_s"]["p99"], 1e3, 1),
            _fmt(s["e2e_s"]["p50"]), _fmt(s["slot_wait_s"]["p50"]),
            _fmt(s["output_throughput_tok_s"], digits=1),
            _fmt(s["total_throughput_tok_s"], digits=1),
            _fmt(m.get("kv_usage_peak"), 100, 0), _fmt(m.get("preemptions"), digits=0),
        ])
    if compact:
        keep = [headers.index(h) for h in COMPACT]
        return list(COMPACT), [[row[i] for i in keep] for row in rows]
    return headers, rows


def phase_lines(summaries: list[dict]) -> list[str]:
    """One line per level with phases (shared prefix: cold vs warm median TTFT)."""
    lines = []
    for s in summaries:
        phases = s.get("ttft_by_phase") or {}
        parts = [f"{name} {_fmt(v['p50'])} s (n={v['n']})" for name, v in phases.items()]
        if parts:
            lines.append(f"{s['level']}: median TTFT {', '.join(parts)}")
    return lines


def write_json(result: BenchResult, path: Path) -> Path:
    """results.json: definitions, meta, summaries, records (no text), anomalies, notes."""
    records = [{k: v for k, v in asdict(r).items() if k != "answer"} | {
        "slot_wait_s": r.slot_wait_s} for r in result.records]
    body = {
        "definitions": DEFINITIONS,
        "meta": result.meta,
        "summaries": result.summaries,
        "anomalies": [asdict(a) | {"ratio": a.ratio, "message": a.message()}
                      for a in result.anomalies],
        "notes": result.notes,
        "overlay": result.overlay,
        "requests": records,
    }
    path.write_text(json.dumps(body, indent=1, default=str))
    return path


def write_csv(result: BenchResult, path: Path) -> Path:
    """results.csv: one row per request (ITL as its mean; every gap is in results.json)."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in result.records:
            row = {k: v for k, v in asdict(r).items() if k in CSV_FIELDS}
            row["slot_wait_s"] = r.slot_wait_s
            row["itl_mean_s"] = sum(r.itl_s) / len(r.itl_s) if r.itl_s else None
            row["notes"] = "; ".join(r.notes)
            writer.writerow(row)
    return path


def write_plots(result: BenchResult, out_dir: Path) -> list[Path]:
    """Every plot that has data; returns the written paths."""
    overlay = result.overlay or {}
    made = [
        plots.plot_ttft(result.summaries, out_dir, result.anomalies, overlay.get("ttft_curve")),
        plots.plot_tpot(result.summaries, out_dir, result.anomalies, overlay.get("tpot_curve")),
        plots.plot_throughput(result.summaries, out_dir),
        plots.plot_shared_prefix(result.summaries, out_dir),
    ]
    return [p for p in made if p is not None]


def _html_table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _list(items: list[str]) -> str:
    return "<ul>" + "".join(f"<li>{html.escape(i)}</li>" for i in items) + "</ul>"


def write_html(result: BenchResult, pngs: list[Path], path: Path) -> Path:
    """report.html: metadata, definitions, table, embedded plots, anomalies, overlay, notes."""
    meta = _html_table(["run", "value"], [[k, str(v)] for k, v in result.meta.items()])
    defs = _html_table(["metric", "definition"], [[k, v] for k, v in DEFINITIONS.items()])
    figures = "".join(
        f'<figure><img alt="{p.name}" src="data:image/png;base64,'
        f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{p.name}</figcaption></figure>'
        for p in pngs)
    anomalies = [a.message() for a in result.anomalies] or [NO_ANOMALY]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvledger bench</title>",
        STYLE,
        "<h1>kvledger bench report</h1>", meta,
        "<h2>Summary (latencies in seconds unless marked)</h2>",
        _html_table(*table(result.summaries)), _list(phase_lines(result.summaries)),
        "<h2>Anomalies</h2>", _list(anomalies),
    ]
    if result.overlay:
        rows = [[r["level"], r["metric"], f"{r['measured']:.4g}", f"{r['floor']:.4g}",
                 r.get("floor_basis", ""), f"{r['ratio']:.2f}"] for r in result.overlay["rows"]]
        parts += [f"<h2>Ledger overlay ({html.escape(result.overlay['title'])})</h2>",
                  _html_table(["level", "metric", "measured s", "ledger s", "ledger for",
                               "measured/ledger"], rows),
                  _list(result.overlay.get("notes", []))]
    parts += ["<h2>Plots</h2>", figures, "<h2>Definitions</h2>", defs]
    if result.notes:
        parts += ["<h2>Notes</h2>", _list(result.notes)]
    parts.append("</body></html>")
    path.write_text("\n".join(parts))
    return path


def write_all(result: BenchResult, out_dir: Path) -> list[Path]:
    """Write every output into ``out_dir`` (created if needed); returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    pngs = write_plots(result, out_dir)
    return [write_json(result, out_dir / "results.json"),
            write_csv(result, out_dir / "results.csv"), *pngs,
            write_html(result, pngs, out_dir / "report.html")]
