"""Load or recompute: the ledger's prediction of reading KV blocks from a tier against
prefilling their tokens again (issue 39), and the crossover ``kvledger plan`` prints.

Formulas:

  load seconds       ``files x per-file seconds + bytes / read bytes-per-s``, with the speeds
                     ``kvledger probe --kv-disk-dir`` measured (:class:`ReadSpeed`: page cache
                     dropped, and warm).
  recompute seconds  prefill FLOPs of tokens ``[start, end)`` with ``[0, start)`` already in
                     the pool, ``prefill_flops(end) - prefill_flops(start)``
                     (:func:`kvledger.ledger.costs.prefill_flops`: ``2 x active params`` per
                     token plus the causal attention pairs those tokens add), over the prefill
                     FLOP/s (measured by the probe for the engine; ``peak x MFU`` in the plan).
  crossover          the fewest whole blocks from position 0 whose load is faster than their
                     recompute. Recompute grows faster than linearly in the tokens (attention)
                     and the load linearly, so beyond the crossover loading keeps winning.

The probe's figures are saved per tier directory in the config folder, ``kv_tier_read.json``
(:func:`save_figures`), as ``{"<absolute dir>": {"cold_bytes_per_s", "cold_file_s",
"warm_bytes_per_s", "warm_file_s", "prefill_flops_per_s", ...}}``; the engine and ``kvledger
plan --kv-disk-dir`` read them (:func:`saved_figures`). No torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvledger.errors import InvalidParameterError
from kvledger.ledger.costs import prefill_flops
from kvledger.spec import ModelSpec

SAVED_NAME = "kv_tier_read.json"


@dataclass(frozen=True)
class ReadSpeed:
    """How fast a tier's block files read (the whole load path: read and checks).

    Attributes:
        bytes_per_s: payload bytes per second.
        file_s: seconds per file beyond its bytes (open, header, syscalls); 0 when not measured.
    """

    bytes_per_s: float
    file_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0 or self.file_s < 0:
            raise InvalidParameterError(f"a read speed needs bytes/s > 0 and seconds per file "
                                        f">= 0, got {self.bytes_per_s} and {self.file_s}")

    def seconds(self, num_bytes: int, files: int) -> float:
        """Predicted seconds to load ``files`` files holding ``num_bytes`` payload bytes."""
        return files * self.file_s + num_bytes / self.bytes_per_s


def recompute_flops(spec: ModelSpec, params_active: int, start: int, end: int) -> int:
    """FLOPs of prefilling tokens ``[start, end)`` when ``[0, start)`` are cached."""
    if not 0 <= start <= end:
        raise InvalidParameterError(f"token range [{start}, {end}) is not a range")
    return prefill_flops(spec, end, params_active) - prefill_flops(spec, start, params_active)


def recompute_seconds(spec: ModelSpec, params_active: int, start: int, end: int,
                      flops_per_s: float) -> float:
    """Predicted seconds of prefilling tokens ``[start, end)`` at ``flops_per_s``."""
    return recompute_flops(spec, params_active, start, end) / flops_per_s


@dataclass(frozen=True)
class Crossover:
    """Where loading a prefix from the tier starts to beat recomputing it.

    Attributes:
        tokens: the fewest tokens (whole blocks, from position 0) whose load is faster than
            their prefill; None when recompute wins up to ``max_tokens``.
        bytes: the KV bytes of those tokens (None with ``tokens``).
        read: the read speed assumed.
        flops_per_s: the prefill speed assumed.
        max_tokens: the longest prefix looked at (the model's context).
    """

    tokens: int | None
    bytes: int | None
    read: ReadSpeed
    flops_per_s: float
    max_tokens: int


def crossover(spec: ModelSpec, params_active: int, block_bytes: int, block_size: int,
              read: ReadSpeed, flops_per_s: float, max_tokens: int) -> Crossover:
    """The crossover of loading ``block_bytes``-byte blocks of ``block_size`` tokens at
    ``read`` against prefilling them at ``flops_per_s`` (module docstring)."""
    if flops_per_s <= 0:
        raise InvalidParameterError(f"the prefill speed must be positive, got {flops_per_s}")
    def loads_faster(blocks: int) -> bool:
        return read.seconds(blocks * block_bytes, blocks) < recompute_seconds(
            spec, params_active, 0, blocks * block_size, flops_per_s)

    low, high = 1, max_tokens // block_size  # loading wins from some blocks on: bisect
    if high < 1 or not loads_faster(high):
        return Crossover(None, None, read, flops_per_s, max_tokens)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if loads_faster(mid) else (mid + 1, high)
    return Crossover(low * block_size, low * block_bytes, read, flops_per_s, max_tokens)


@dataclass(frozen=True)
class TierFigures:
    """What the probe measured for one tier directory; None where never measured.

    Attributes:
        cold: read speed with the page cache dropped.
        warm: read speed from the page cache.
        prefill_flops_per_s: the engine's prefill speed.
    """

    cold: ReadSpeed | None = None
    warm: ReadSpeed | None = None
    prefill_flops_per_s: float | None = None


def save_figures(directory: Path, figures: dict, config: Path) -> Path:
    """Store the probe's ``figures`` for tier ``directory`` in ``config/kv_tier_read.json``
    (the other directories' are kept); returns the file."""
    path = config / SAVED_NAME
    known = _load(path)
    known[str(Path(directory).expanduser().resolve())] = figures
    config.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known, indent=1))
    return path


def _load(path: Path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _positive(figures: dict, name: str) -> float | None:
    value = figures.get(name)
    return float(value) if isinstance(value, int | float) and value > 0 else None


def saved_figures(directory: Path, config: Path) -> TierFigures:
    """The figures saved for tier ``directory``; a figure never probed, or malformed, is
    None (a malformed file reads as empty)."""
    figures = _load(config / SAVED_NAME).get(str(Path(directory).expanduser().resolve()))
    figures = figures if isinstance(figures, dict) else {}
    speeds = []
    for state in ("cold", "warm"):
        per_s = _positive(figures, f"{state}_bytes_per_s")
        speeds.append(None if per_s is None else
                      ReadSpeed(per_s, _positive(figures, f"{state}_file_s") or 0.0))
    return TierFigures(speeds[0], speeds[1], _positive(figures, "prefill_flops_per_s"))
