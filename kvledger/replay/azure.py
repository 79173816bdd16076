"""Import the Azure LLM inference trace (CSV) as a kvledger trace.

Microsoft's public traces of LLM inference in Azure (the ``AzureLLMInferenceDataset2023``
files of the Azure/AzurePublicDataset repository on GitHub, "code" and "conversation"
services) have one row per request with the columns ``TIMESTAMP`` (when the request arrived,
``YYYY-MM-DD HH:MM:SS.fffffff``), ``ContextTokens`` (prompt length) and ``GeneratedTokens``
(output length). They carry no token ids and no prefix information, so the imported requests
share nothing in the prefix cache. Arrival times are made relative to the earliest row;
``max_tokens`` is the generated length, so the admission rule sees what the request needed.
A numeric ``TIMESTAMP`` is read as seconds.
"""

from __future__ import annotations

import csv
import datetime
from pathlib import Path

from kvledger.replay.trace import FORMAT, VERSION, Trace, TraceError, TraceRequest

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _seconds(text: str) -> float:
    """Seconds since the epoch of a TIMESTAMP cell (fractions past microseconds dropped)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    day, _, frac = text.partition(".")
    stamp = datetime.datetime.fromisoformat(day + ("." + frac[:6] if frac else ""))
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.UTC)
    return stamp.timestamp()


def read_azure(path: str | Path, max_requests: int | None = None) -> Trace:
    """Read an Azure LLM inference trace CSV (see the module docstring) as a Trace.

    Raises:
        TraceError: missing file or column, or a bad row (with its line number).
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {str(path)!r} not found")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(f"{path.name}: not an Azure LLM inference trace: no column "
                             f"{', '.join(missing)} (columns: {', '.join(COLUMNS)})")
        rows = []
        for row in reader:
            line = reader.line_num
            try:
                t = _seconds(row["TIMESTAMP"])
                prompt, out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (ValueError, TypeError):
                raise TraceError(f"{path.name}:{line}: bad row {dict(row)}") from None
            if prompt < 1 or out < 0:
                raise TraceError(f"{path.name}:{line}: ContextTokens must be >= 1 and "
                                 f"GeneratedTokens >= 0, got {prompt}, {out}")
            rows.append((t, prompt, out))
            if max_requests is not None and len(rows) >= max_requests:
                break
    t0 = min((t for t, _, _ in rows), default=0.0)
    requests = [TraceRequest(f"azure-{i}", t - t0, prompt, max_tokens=max(out, 1),
                             output_tokens=out) for i, (t, prompt, out) in enumerate(rows)]
    header = {"type": "header", "format": FORMAT, "version": VERSION, "source": "azure",
              "model": None, "private": True, "hash_block_size": None, "engine": None,
              "num_blocks": None}
    return Trace(header, sorted(requests, key=lambda r: r.arrival_s))
