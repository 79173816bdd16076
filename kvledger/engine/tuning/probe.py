"""The kernel probe: which weight format per matmul shape class, and which attention backend.

Nothing is assumed about the device (``kvledger.device.Device``; today the CPU): a short measurement picks, for each shape class of the model
(``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``; [out, in] from the spec), the fastest of
:data:`kvledger.model.linear.FORMATS` for one decode row (bf16 activations; random weights of
the real shape, each call on a weight evicted from the caches, as in a decode step, which
streams every layer's weights from memory), the fastest attention backend for one decode query over 512 positions (once
over a bf16 pool and once over an int8 pool: the quantized formats' choice, since a backend
fastest on plain blocks may not be once it dequantizes), and up to how many rows the native
fused element-wise ops (the device's ``Kernels.fused_ops``, one thread) beat PyTorch's (vectorised,
all threads) — a decode step has a few rows, a prefill hundreds. For the many rows of a
prefill, it also times each format's own kernel against the GEMM paths on the weight
dequantized per call (``fp32``, ``bf16``: :meth:`kvledger.model.linear.Linear.gemm`) and
picks the path and the row count it starts at (:meth:`ProbeResult.gemm_choice`).
The timing (interleaved rounds, best of several, in microseconds) is :mod:`.timing`; this
module turns it into choices and caches it, and :class:`.tuned.TunedDevice` hands the choices
to the engine and the model.

Results are cached as JSON in ``cache_dir()/probe/kernels.json``, one entry per key = sha256 of
(the device's identity: CPU model and flags; torch version, threads, the shapes, the digest of
the device's kernel sources), so a
new CPU, torch, model or kernel re-probes, and the same key always gives the same choice. A
corrupt file is ignored with a warning and rewritten. Forcing: ``KVLEDGER_WEIGHT_FORMAT`` (one format for every class, or
``class=format,...``), ``KVLEDGER_GEMM`` (the many-row path, :func:`forced_gemm`) and
``KVLEDGER_ATTENTION`` override the probe; ``int4`` and ``w4a8`` apply only to
weights the GGUF stores as Q4 (others stay dense; ``w4a8`` without the native library is ``int4``),
the ``kquant`` formats only to weights held as a K-quant GGUF's blocks (whose native paths the
probe times on Q4_K blocks of each class's shape; any other format dequantizes them at load).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field

import torch

from kvledger.device import Device
from kvledger.engine.tuning import timing
from kvledger.engine.tuning.timing import EVICT_BYTES_MIN, FUSED_DTYPES, FUSED_ROWS, GEMM_ROWS
from kvledger.errors import InvalidParameterError
from kvledger.model.linear import FORMATS, GEMM_PATHS, KQUANT_FORMATS, Q4_FORMATS
from kvledger.paths import cache_dir
from kvledger.spec import ModelSpec

log = logging.getLogger("kvledger.engine")
CLASSES = ("qkv", "o", "gate_up", "down", "lm_head")
GEMM_CLASSES = CLASSES[:4]
"""The classes with a many-row GEMM path (the LM head sees one row per sampled sequence)."""
REFERENCE_REQUEST = (512, 128)
"""(prompt tokens, new tokens) of the request whose matmul time picks each class's format."""
DENSE_FORMATS = tuple(f for f in FORMATS if f not in KQUANT_FORMATS)
"""The formats of a weight held dense or as Q4 parts (not as a GGUF's blocks)."""
NOT_Q4_FORMATS = tuple(f for f in DENSE_FORMATS if f not in Q4_FORMATS)
"""The formats of a dense weight the GGUF does not store as Q4."""
@dataclass
class ProbeResult:
    """What the probe measured and chose.

    Attributes:
        cpu: CPU model and flags; torch_version; threads: torch intra-op threads.
        matmul_us: class -> format -> best time of one decode row, weight evicted from the
            caches first, µs.
        gemm_us: class -> format -> rows (as text, :data:`GEMM_ROWS`) -> ``{"own": µs,
            path: µs, ...}`` for the GEMM paths (``fp32``, ``bf16``) other than the format's
            own kernel (none for int4); no ``lm_head`` (it sees one row per sequence).
        attention_us: backend -> best time of one decode query over 512 positions, µs.
        fused_us: ``"op:dtype"`` (e.g. ``"silu_mul:bf16"``) -> rows (as text) ->
            ``{"native": µs, "torch": µs}``; empty when the native library is unavailable.
        quantized_attention_us: as ``attention_us``, over an int8 pool (keys per channel).
    """

    cpu: str
    torch_version: str
    threads: int
    matmul_us: dict[str, dict[str, float]]
    attention_us: dict[str, float]
    fused_us: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    gemm_us: dict[str, dict[str, dict[str, dict[str, float]]]] = field(default_factory=dict)
    quantized_attention_us: dict[str, float] = field(default_factory=dict)

    def weight_format(self, shape_class: str, available: tuple[str, ...] = FORMATS) -> str:
        """The format among ``available`` with the least matmul time for
        :data:`REFERENCE_REQUEST`: one decode row per new token, the prompt in chunks of the
        largest :data:`GEMM_ROWS` through the faster path (decode rows only where no chunk
        was timed)."""
        prompt, new = REFERENCE_REQUEST
        chunk = max(GEMM_ROWS)

        def cost(fmt: str) -> float:
            by_rows = self.gemm_us.get(shape_class, {}).get(fmt, {})
            chunk_us = min(by_rows[str(chunk)].values()) if str(chunk) in by_rows else 0.0
            return new * self.matmul_us[shape_class][fmt] + prompt / chunk * chunk_us

        times = self.matmul_us[shape_class]
        return min((f for f in available if f in times), key=cost)

    def gemm_choice(self, shape_class: str, fmt: str) -> tuple[int, str] | None:
        """(rows, path): from how many rows ``fmt``'s layers of ``shape_class`` take which
        GEMM path (:data:`kvledger.model.linear.GEMM_PATHS`); None: always the own kernel.
        The path is the fastest at the largest of :data:`GEMM_ROWS`; it starts at the smallest
        count from which it beat the own kernel at every larger measured count."""
        by_rows = self.gemm_us.get(shape_class, {}).get(fmt, {})
        counts = sorted(by_rows, key=int, reverse=True)
        if not counts:
            return None
        top = by_rows[counts[0]]
        path = min(top, key=top.__getitem__)
        if path == "own":
            return None
        start = None
        for rows in counts:
            times = by_rows[rows]
            if path not in times or times[path] >= times["own"]:
                break
            start = int(rows)
        return start, path

    @property
    def attention(self) -> str:
        """Fastest measured attention backend."""
        return min(self.attention_us, key=self.attention_us.__getitem__)

    def fused_max_rows(self) -> dict[str, dict[torch.dtype, int]]:
        """op -> dtype -> the most rows the native op takes: the largest of :data:`FUSED_ROWS`
        up to which native was faster at every measured count (0: never native); a dtype that
        native won at every count, the largest included, is left out (no limit: its rows are
        threaded, so more rows only widen its lead)."""
        limits: dict[str, dict[torch.dtype, int]] = {}
        for key, by_rows in self.fused_us.items():
            op, _, dtype = key.partition(":")
            best, counts = 0, sorted(by_rows, key=int)
            for rows in counts:
                if by_rows[rows]["native"] >= by_rows[rows]["torch"]:
                    break
                best = int(rows)
            if not counts or best != int(counts[-1]):
                limits.setdefault(op, {})[FUSED_DTYPES[dtype]] = best
        return limits

    @property
    def quantized_attention(self) -> str:
        """Fastest measured backend over quantized KV (the plain choice if none was timed)."""
        times = self.quantized_attention_us or self.attention_us
        return min(times, key=times.__getitem__)


def shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """[out, in] of each shape class of ``spec``'s fused matrices; an MoE model's ``gate_up``
    and ``down`` are one expert's (their format applies per expert)."""
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h = spec.hidden_size
    f = spec.experts.intermediate_size if spec.is_moe else spec.intermediate_size
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * f, h), "down": (h, f),
            "lm_head": (spec.vocab_size, h)}


def _cache_file():
    return cache_dir() / "probe" / "kernels.json"


def _key(spec: ModelSpec, identity: str, digest: str) -> str:
    text = json.dumps([identity, torch.__version__, torch.get_num_threads(), shapes(spec),
                       spec.num_attention_heads, spec.num_kv_heads, spec.head_dim,
                       digest, FUSED_ROWS, GEMM_ROWS, EVICT_BYTES_MIN])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_cache() -> dict:
    path = _cache_file()
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())
        if not isinstance(entries, dict):
            raise TypeError("not a JSON object")
        return entries
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring the corrupt kernel-probe cache %s (%s)", path, exc)
        return {}


_MEMO: dict[tuple[str, str], ProbeResult] = {}
"""(cache file, key) -> result already read or measured in this process: a model's several
choices (formats, GEMM rows, fused limits, attention) parse the cache file once."""


def probe(spec: ModelSpec, device: Device, refresh: bool = False) -> ProbeResult:
    """The probe's result for ``spec`` on ``device`` here: cached, or measured (~seconds) and
    saved.

    Args:
        refresh: measure again even when a cached entry exists.
    """
    cpu = device.identity()
    key = _key(spec, cpu, device.kernels.source_digest())
    memo = (str(_cache_file()), key)
    if not refresh and memo in _MEMO:
        return _MEMO[memo]
    entries = _read_cache()
    if not refresh and key in entries:
        try:
            _MEMO[memo] = ProbeResult(**entries[key])
            return _MEMO[memo]
        except TypeError as exc:
            log.warning("ignoring a malformed kernel-probe cache entry (%s)", exc)
    sizes, evict, kernels = shapes(spec), timing.evictor(), device.kernels
    result = ProbeResult(cpu, torch.__version__, torch.get_num_threads(),
                         {c: timing.time_formats(*sizes[c], kernels, evict) for c in CLASSES},
                         timing.time_attention(spec, kernels),
                         timing.time_fused(spec, kernels),
                         {c: timing.time_gemm(*sizes[c], kernels) for c in GEMM_CLASSES},
                         timing.time_attention(spec, kernels, quantized=True))
    entries[key] = asdict(result)
    _MEMO[memo] = result
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot save the kernel probe to %s (%s)", path, exc)
    return result


def forced_formats() -> dict[str, str]:
    """Formats forced by ``$KVLEDGER_WEIGHT_FORMAT`` (empty when unset).

    Raises:
        InvalidParameterError: an unknown class or format.
    """
    text = os.environ.get("KVLEDGER_WEIGHT_FORMAT", "").strip()
    if not text:
        return {}
    if "=" not in text:
        text = ",".join(f"{c}={text}" for c in CLASSES)
    forced = {}
    for item in text.split(","):
        cls, _, fmt = item.partition("=")
        cls, fmt = cls.strip(), fmt.strip()
        if cls not in CLASSES or fmt not in FORMATS:
            raise InvalidParameterError(
                f"KVLEDGER_WEIGHT_FORMAT: {item!r} is not class=format with class in "
                f"{', '.join(CLASSES)} and format in {', '.join(FORMATS)}")
        forced[cls] = fmt
    return forced


def choose_formats(spec: ModelSpec, device: Device, q4_classes: set[str],
                   kquant_classes: set[str] = frozenset()) -> dict[str, str]:
    """Format per class: forced ones, the rest from the probe (``int4`` only for Q4 weights;
    the fastest native ``kquant`` path for weights held as GGUF blocks, ``kquant-torch`` where
    none was timed)."""
    forced = forced_formats()
    result = None if set(forced) == set(CLASSES) else probe(spec, device)
    chosen = {}
    for cls in CLASSES:
        if cls in forced:
            chosen[cls] = forced[cls]
            continue
        available = candidates(cls, q4_classes, kquant_classes)
        timed = result.matmul_us.get(cls, {})
        chosen[cls] = result.weight_format(cls, available) \
            if any(f in timed for f in available) else available[-1]
    return chosen


def candidates(shape_class: str, q4_classes: set[str],
               kquant_classes: set[str] = frozenset()) -> tuple[str, ...]:
    """The formats the probe may choose for ``shape_class``: the ``kquant`` ones for weights
    held as GGUF blocks (:data:`~kvledger.model.linear.KQUANT_FORMATS`, the fallback last),
    ``int4`` and ``w4a8`` only for Q4 weights."""
    if shape_class in kquant_classes:
        return KQUANT_FORMATS
    return DENSE_FORMATS if shape_class in q4_classes else NOT_Q4_FORMATS


def forced_gemm() -> dict[str, tuple[int, str] | None]:
    """GEMM paths forced by ``$KVLEDGER_GEMM`` (empty when unset): ``PATH[:ROWS]`` for every
    class, or ``class=PATH[:ROWS],...``; PATH is ``own`` (never a GEMM path) or one of
    :data:`kvledger.model.linear.GEMM_PATHS`, taken from ROWS rows on (default 64).

    Raises:
        InvalidParameterError: an unknown class or path, or ROWS not a positive integer.
    """
    text = os.environ.get("KVLEDGER_GEMM", "").strip()
    if not text:
        return {}
    if "=" not in text:
        text = ",".join(f"{c}={text}" for c in GEMM_CLASSES)
    forced: dict[str, tuple[int, str] | None] = {}
    for item in text.split(","):
        cls, _, choice = item.partition("=")
        path, _, rows = choice.strip().partition(":")
        cls, path, rows = cls.strip(), path.strip(), rows.strip() or "64"
        if cls not in GEMM_CLASSES or path not in ("own", *GEMM_PATHS) or not rows.isdigit() \
                or int(rows) < 1:
            raise InvalidParameterError(
                f"KVLEDGER_GEMM: {item!r} is not class=PATH[:ROWS] with class in "
                f"{', '.join(GEMM_CLASSES)}, PATH in own, {', '.join(GEMM_PATHS)} and ROWS >= 1")
        forced[cls] = None if path == "own" else (int(rows), path)
    return forced


def choose_gemm(spec: ModelSpec, device: Device, formats: dict[str, str]
                ) -> dict[str, tuple[int, str] | None]:
    """Class -> (rows, path) from which its layers (in ``formats``) take a GEMM path
    (:meth:`ProbeResult.gemm_choice`), or None; ``$KVLEDGER_GEMM`` overrides
    (:func:`forced_gemm`)."""
    forced = forced_gemm()
    result = None if set(formats) <= set(forced) else probe(spec, device)
    return {cls: forced[cls] if cls in forced else result.gemm_choice(cls, fmt)
            for cls, fmt in formats.items()}


def fused_limits(spec: ModelSpec, device: Device) -> dict[str, dict[torch.dtype, int]]:
    """The probe's row limits of the native fused ops (see :meth:`ProbeResult.fused_max_rows`)."""
    return probe(spec, device).fused_max_rows()


def forced_attention() -> str | None:
    """The backend forced by ``$KVLEDGER_ATTENTION`` (None when unset).

    Raises:
        InvalidParameterError: not a backend's name.
    """
    from kvledger.engine.attention import BACKENDS

    forced = os.environ.get("KVLEDGER_ATTENTION")
    if forced and forced not in BACKENDS:
        raise InvalidParameterError(f"KVLEDGER_ATTENTION must be one of "
                                    f"{', '.join(BACKENDS)}, got {forced!r}")
    return forced or None


def choose_attention(spec: ModelSpec, device: Device, quantized: bool = False) -> str:
    """``$KVLEDGER_ATTENTION`` if set, else the probe's fastest backend (over quantized KV
    when ``quantized``: fp8, int8, int4)."""
    forced = forced_attention()
    if forced:
        return forced
    result = probe(spec, device)
    return result.quantized_attention if quantized else result.attention
