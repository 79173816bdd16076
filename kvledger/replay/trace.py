"""The kvledger trace: a recorded (or imported) workload as JSON lines, one object per line.

Every line is a JSON object with a ``type``; times are seconds from the trace's start (the
recorder's ``time.perf_counter()`` origin), lengths are tokens. Lines of other types are
ignored, so the format can grow. Version 1:

``header`` (first line, once)
    ``format`` = ``"kvledger-trace"``, ``version`` = 1, ``created`` (ISO 8601 UTC), ``source``
    (``serve``, ``bench``, ``azure`` ...), ``model`` (name, may be null), ``private`` (bool),
    ``hash_block_size`` (tokens per hashed block of private requests, null when not private),
    ``engine`` (the recording engine's options, EngineConfig field names, or null) and
    ``num_blocks`` (its KV pool in blocks, or null).
``request``
    ``id`` (unique in the trace), ``arrival_s``, then the prompt as either
    ``prompt_token_ids`` (a list of ints) or, in a private trace, ``prompt_tokens`` (its length)
    and ``block_hashes`` (hex strings, one per full block of ``hash_block_size`` tokens: the
    chained hash of the prefix cache computed without any cache salt, so equal hashes mean
    equal prefixes and nothing else about the text). ``max_tokens`` (int or null = up to the
    context), ``sampling`` (an object of the other SamplingParams fields that were set, may be
    empty), ``session`` (conversation id or null), ``output_tokens`` (how many tokens it
    generated, when the producer knows it without a ``finish`` line: bench, importers).
``finish``
    ``id``, ``time_s``, ``reason`` (``stop``, ``length``, ``abort``, ``error``),
    ``output_tokens``, ``output_token_ids`` (non-private traces), and the server-side timings
    the engine measured: ``ttft_s`` (arrival -> first token), ``tpot_s`` ((last - first token) /
    (n - 1)), ``queue_s`` (arrival -> first scheduled), ``e2e_s`` (arrival -> finished),
    ``preemptions`` and ``peak_kv_blocks``.
``refused``
    ``id``, ``arrival_s``, ``error``: the engine refused the request at admission.
``step``
    ``index`` (from 0), ``start_s``, ``duration_s`` (of the engine's ``step()``), ``chunks``
    (``[request id, first token position, tokens computed]`` per scheduled chunk, in the
    scheduler's order), ``preempted`` and ``failed`` (request ids), and ``evicted``: per
    request of a token-level retention policy (h2o, snapkv) whose eviction after this step
    dropped tokens, ``[request id, [[lo, hi], ...]]`` (the dropped positions as half-open
    runs); absent when the producer did not record evictions (older traces, bench, importers).

A request's output length for replay is its ``finish`` line's ``output_tokens``, else its own
``output_tokens``, else ``max_tokens``.
"""

from __future__ import annotations

import datetime
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from kvledger.engine.kv.prefix import block_hash_key, hash_block_key
from kvledger.errors import KVLedgerError

FORMAT = "kvledger-trace"
VERSION = 1


class TraceError(KVLedgerError):
    """A trace file cannot be read: missing, malformed line (with its number), wrong format."""


def block_hashes(token_ids: list[int], block_size: int) -> list[str]:
    """Unsalted chained hashes (hex) of the full blocks of ``token_ids``, as the prefix cache
    computes them with no cache salt (``kvledger.engine.kv.prefix``)."""
    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_key(block_hash_key(parent, token_ids[i * block_size:(i + 1) *
                                                                 block_size], ()))
        out.append(parent.hex())
    return out


@dataclass
class TraceRequest:
    """One request of a trace (see the module docstring for the fields)."""

    id: str
    arrival_s: float
    prompt_tokens: int
    prompt_token_ids: list[int] | None = None
    block_hashes: list[str] | None = None
    max_tokens: int | None = None
    sampling: dict = field(default_factory=dict)
    session: str | None = None
    output_tokens: int | None = None
    finish: dict | None = None

    @property
    def target_output_tokens(self) -> int | None:
        """Tokens it generates in replay: the finish line's, else its own, else max_tokens."""
        if self.finish is not None and self.finish.get("output_tokens") is not None:
            return self.finish["output_tokens"]
        return self.output_tokens if self.output_tokens is not None else self.max_tokens


@dataclass
class Trace:
    """A parsed trace: header, requests in arrival order, refused requests, recorded steps."""

    header: dict
    requests: list[TraceRequest]
    refused: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)


def _require(obj: dict, key: str, kind, where: str):
    value = obj.get(key)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        named = "a number" if kind == (int, float) else " or ".join(
            k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        problem = "missing" if value is None else f"got {value!r}"
        raise TraceError(f"{where}: field {key!r} must be {named} ({problem})")
    return value


def _request(obj: dict, where: str, header: dict) -> TraceRequest:
    rid = str(_require(obj, "id", (str, int), where))
    arrival = float(_require(obj, "arrival_s", (int, float), where))
    ids = obj.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise TraceError(f"{where}: prompt_token_ids must be a non-empty list of ints")
        n = len(ids)
    else:
        n = _require(obj, "prompt_tokens", int, where)
        if n < 1:
            raise TraceError(f"{where}: prompt_tokens must be >= 1, got {n}")
        hashes = obj.get("block_hashes") or []
        if hashes and not header.get("hash_block_size"):
            raise TraceError(f"{where}: block_hashes given but the header has no hash_block_size")
        if len(hashes) * (header.get("hash_block_size") or 0) > n:
            raise TraceError(f"{where}: {len(hashes)} block hashes of "
                             f"{header['hash_block_size']} tokens exceed prompt_tokens {n}")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise TraceError(f"{where}: max_tokens must be a positive int or null, got {max_tokens!r}")
    out = obj.get("output_tokens")
    if out is not None and (not isinstance(out, int) or out < 0):
        raise TraceError(f"{where}: output_tokens must be an int >= 0, got {out!r}")
    return TraceRequest(rid, arrival, n, ids, obj.get("block_hashes") if ids is None else None,
                        max_tokens, dict(obj.get("sampling") or {}), obj.get("session"), out)


def read_trace(path: str | Path) -> Trace:
    """Parse a trace file.

    Raises:
        TraceError: the file is missing, a line is not a JSON object or lacks a field (the
            message names the line number), the header is missing or of another format, or a
            request id repeats.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file {str(path)!r} not found")
    header: dict | None = None
    requests: dict[str, TraceRequest] = {}
    trace = Trace({}, [])
    with path.open() as f:
        for number, line in enumerate(f, 1):
            where = f"{path.name}:{number}"
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict) or "type" not in obj:
                raise TraceError(f"{where}: each line must be a JSON object with a 'type'")
            kind = obj["type"]
            if header is None:
                if kind != "header" or obj.get("format") != FORMAT:
                    raise TraceError(f"{where}: the first line must be the {FORMAT} header")
                if obj.get("version") != VERSION:
                    raise TraceError(f"{where}: trace version {obj.get('version')!r}; this "
                                     f"kvledger reads version {VERSION}")
                header = obj
            elif kind == "request":
                req = _request(obj, where, header)
                if req.id in requests:
                    raise TraceError(f"{where}: request id {req.id!r} repeats")
                requests[req.id] = req
            elif kind == "finish":
                rid = str(obj.get("id"))
                if rid not in requests:
                    raise TraceError(f"{where}: finish of unknown request {rid!r}")
                requests[rid].finish = obj
            elif kind == "refused":
                trace.refused.append(obj)
            elif kind == "step":
                for key in ("start_s", "duration_s"):
                    _require(obj, key, (int, float), where)
                trace.steps.append(obj)
    if header is None:
        raise TraceError(f"{path.name}: empty trace (no header line)")
    trace.header = header
    trace.requests = sorted(requests.values(), key=lambda r: r.arrival_s)
    return trace


class TraceWriter:
    """Writes trace lines to a file, thread-safe, flushed per line (a crash keeps what ran).

    Args:
        path: the file (created or truncated).
        source: who produced the trace (``serve``, ``bench`` ...).
        model: model name, or None.
        private: requests carry lengths and block hashes instead of token ids.
        hash_block_size: tokens per hashed block (private traces).
        engine: the recording engine's options (EngineConfig fields), or None.
        num_blocks: its KV pool in blocks, or None.
    """

    def __init__(self, path: str | Path, source: str, model: str | None = None,
                 private: bool = False, hash_block_size: int = 16,
                 engine: dict | None = None, num_blocks: int | None = None) -> None:
        self.private = private
        self.hash_block_size = hash_block_size
        self._lock = threading.Lock()
        self._file: IO[str] = Path(path).open("w")  # noqa: SIM115 - open until close()
        self.write({"type": "header", "format": FORMAT, "version": VERSION,
                    "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "source": source, "model": model, "private": private,
                    "hash_block_size": hash_block_size if private else None,
                    "engine": engine, "num_blocks": num_blocks})

    def write(self, obj: dict) -> None:
        """Append one line."""
        line = json.dumps(obj, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def prompt_fields(self, token_ids: list[int]) -> dict:
        """The prompt part of a request line: token ids, or length + block hashes if private."""
        if not self.private:
            return {"prompt_token_ids": list(token_ids)}
        return {"prompt_tokens": len(token_ids),
                "block_hashes": block_hashes(token_ids, self.hash_block_size)}

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()
