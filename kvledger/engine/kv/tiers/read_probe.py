"""The disk tier's read bandwidth, measured by ``kvledger probe --kv-disk-dir DIR`` and saved
for the engine's load-or-recompute choice (``link.LoadPolicy``).

``measure_read`` writes ``files`` block-sized files in a scratch folder inside the directory
(fsynced), then reads them all twice: *cold*, after ``posix_fadvise(POSIX_FADV_DONTNEED)`` has
dropped each file's pages from the page cache, and *warm*, right after. The figures are saved
per directory in the config folder (``kv_tier_read.json``); the engine predicts a load with the
cold figure (the pessimistic one).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

SAVED_NAME = "kv_tier_read.json"


def _read_all(paths: list[Path]) -> float:
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 20):
                pass
    return time.perf_counter() - start


def measure_read(directory: Path, files: int = 64, file_bytes: int = 368_640) -> dict:
    """``{"cold_bytes_per_s", "warm_bytes_per_s", "bytes"}`` of reading ``files`` files of
    ``file_bytes`` bytes in ``directory``."""
    scratch = Path(directory) / f".read-probe.{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        paths = []
        for i in range(files):
            path = scratch / f"{i}.bin"
            with open(path, "wb") as f:
                f.write(os.urandom(file_bytes))
                f.flush()
                os.fsync(f.fileno())
            paths.append(path)
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        cold = _read_all(paths)
        warm = _read_all(paths)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    total = files * file_bytes
    return {"cold_bytes_per_s": total / cold, "warm_bytes_per_s": total / warm, "bytes": total}


def save(directory: Path, figures: dict, config: Path) -> Path:
    """Store ``figures`` for ``directory`` in ``config/kv_tier_read.json``; returns the file."""
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


def saved_cold_bytes_per_s(directory: Path, config: Path) -> float | None:
    """The saved cold read bandwidth of ``directory`` (bytes/s), None when never probed or the
    file is malformed."""
    figures = _load(config / SAVED_NAME).get(str(Path(directory).expanduser().resolve()))
    value = figures.get("cold_bytes_per_s") if isinstance(figures, dict) else None
    return float(value) if isinstance(value, int | float) and value > 0 else None
