"""The figures of the engine's load-or-recompute choice (``link.LoadPolicy``), measured by
``kvledger probe --kv-disk-dir DIR`` and saved per directory.

``measure_read`` times the disk tier's own load path (:meth:`DiskTier.get`: read the file,
check the header and the payload's CRC-32) over ``files`` block files it writes in a scratch
folder inside the directory: *cold*, after ``posix_fadvise(POSIX_FADV_DONTNEED)`` has dropped
each file's pages from the page cache, and *warm*, right after. It does so at two payload sizes
(a block's, and an eighth of it) and fits ``seconds per file = file_s + bytes / bytes_per_s``
through the two points, for each of cold and warm (:class:`kvledger.ledger.tier_load.ReadSpeed`).
The probe adds the prefill speed (``prefill_flops_per_s``) it timed on an engine beside them.
The figures are saved per directory in the config folder (``kv_tier_read.json``,
:func:`kvledger.ledger.tier_load.save_figures`); the engine reads its directory's.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from kvledger.engine.kv.prefix import hash_block_key
from kvledger.engine.kv.tiers.disk import DiskTier
from kvledger.ledger.tier_load import ReadSpeed

SMALL_FRACTION = 8  # the second payload size of the fit: a block's / 8


def _load_all(tier: DiskTier, blocks: list, cold: bool) -> float:
    """Seconds to load every block of ``blocks`` from ``tier``, page cache dropped first when
    ``cold``."""
    if cold:
        for block_hash, _ in blocks:
            fd = os.open(tier.path(block_hash), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    start = time.perf_counter()
    for block_hash, key in blocks:
        if tier.get(block_hash, key) is None:
            raise OSError(f"the read probe's block file {tier.path(block_hash)} did not load")
    return time.perf_counter() - start


def _per_file_seconds(scratch: Path, files: int, payload_bytes: int) -> tuple[float, float]:
    """(cold, warm) seconds per file of ``payload_bytes``-byte blocks."""
    tier = DiskTier(scratch, f"{payload_bytes:016x}", 1 << 62, payload_bytes)
    blocks = []
    for i in range(files):
        key = (None, (i, payload_bytes), ("read-probe",))
        block_hash = hash_block_key(key)
        tier.put(block_hash, key, os.urandom(payload_bytes))
        blocks.append((block_hash, key))
    cold = _load_all(tier, blocks, cold=True)
    warm = _load_all(tier, blocks, cold=False)
    return cold / files, warm / files


def _fit(big: int, t_big: float, small: int, t_small: float) -> ReadSpeed:
    """The line through (small, t_small) and (big, t_big): seconds per file against bytes;
    all of it per byte when the points give no positive per-file time or slope."""
    if t_big > t_small:
        per_byte = (t_big - t_small) / (big - small)
        file_s = t_big - big * per_byte
        if file_s >= 0:
            return ReadSpeed(1 / per_byte, file_s)
    return ReadSpeed(big / t_big)


def measure_read(directory: Path, files: int = 64, payload_bytes: int = 368_640) -> dict:
    """``{"cold_bytes_per_s", "cold_file_s", "warm_bytes_per_s", "warm_file_s", "files",
    "payload_bytes"}`` of loading ``files`` block files of ``payload_bytes`` (and of an eighth
    of it) from ``directory``."""
    scratch = Path(directory) / f".read-probe.{os.getpid()}"
    small = max(1, payload_bytes // SMALL_FRACTION)
    try:
        big_cold, big_warm = _per_file_seconds(scratch, files, payload_bytes)
        small_cold, small_warm = _per_file_seconds(scratch, files, small)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cold = _fit(payload_bytes, big_cold, small, small_cold)
    warm = _fit(payload_bytes, big_warm, small, small_warm)
    return {"cold_bytes_per_s": cold.bytes_per_s, "cold_file_s": cold.file_s,
            "warm_bytes_per_s": warm.bytes_per_s, "warm_file_s": warm.file_s,
            "files": files, "payload_bytes": payload_bytes}
