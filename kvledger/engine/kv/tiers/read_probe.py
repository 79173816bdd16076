"""The figures of the engine's load-or-recompute choice (``link.LoadPolicy``), measured by
``kvledger probe --kv-disk-dir DIR`` and saved per directory.

``measure_read`` times the engine's own load path over ``files`` block files it writes in a
scratch folder inside the directory: :meth:`DiskTier.get` (read the file, check the header and
the payload's CRC-32), then :func:`payload.write_blocks` into a pool of the store's tensors
(``tensor_bytes``: one block's bytes of each, K and V of every layer); *cold*, after
``posix_fadvise(POSIX_FADV_DONTNEED)`` has dropped each file's pages from the page cache, and
*warm*, right after. It does so at two payload sizes (a block's, and an eighth of it) and fits
``seconds per file = file_s + bytes / bytes_per_s`` through the two points, for each of cold
and warm (:class:`kvledger.ledger.tier_load.ReadSpeed`).
The probe adds the prefill speed (``prefill_flops_per_s``) it timed on an engine beside them.
The figures are saved per directory in the config folder (``kv_tier_read.json``,
:func:`kvledger.ledger.tier_load.save_figures`); the engine reads its directory's.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from kvledger.engine.kv.prefix import hash_block_key
from kvledger.engine.kv.tiers.disk import DiskTier
from kvledger.engine.kv.tiers.payload import write_blocks
from kvledger.ledger.kv import layer_block_bytes
from kvledger.ledger.kv_format import KVFormatSpec
from kvledger.ledger.tier_load import ReadSpeed
from kvledger.spec import ModelSpec

SMALL_FRACTION = 8  # the second payload size of the fit: a block's / 8


def store_tensor_bytes(spec: ModelSpec, block_size: int = 16) -> list[int]:
    """One block's bytes of each store tensor of ``spec`` in bf16 (K, V of every layer; the
    ledger's layer block bytes halved: the tiers run full-attention layers only)."""
    fmt = KVFormatSpec("bf16")
    return [layer_block_bytes(spec, fmt, 1, block_size, kind) // 2
            for kind in spec.layers.types for _ in "KV"]


def _pool(files: int, tensor_bytes: list[int]) -> SimpleNamespace:
    """A store of ``files`` blocks with one uint8 tensor per entry of ``tensor_bytes``, K and V
    alternating as ``payload`` orders them."""
    blocks = [torch.zeros(files, n, dtype=torch.uint8) for n in tensor_bytes]  # pages touched
    return SimpleNamespace(quantized=False, key_blocks=blocks[::2], value_blocks=blocks[1::2])


def _load_all(tier: DiskTier, blocks: list, pool, cold: bool) -> float:
    """Seconds to load every block of ``blocks`` from ``tier`` into ``pool``, page cache
    dropped first when ``cold``."""
    if cold:
        for block_hash, _ in blocks:
            fd = os.open(tier.path(block_hash), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    start = time.perf_counter()
    payloads = [tier.get(block_hash, key) for block_hash, key in blocks]
    if any(p is None for p in payloads):
        raise OSError(f"a block file of the read probe in {tier.dir} did not load")
    write_blocks(pool, list(range(len(payloads))), payloads)
    return time.perf_counter() - start


def _per_file_seconds(scratch: Path, files: int, tensor_bytes: list[int]) -> tuple[float, float]:
    """(cold, warm) seconds per file of blocks of ``tensor_bytes`` (bytes of each tensor)."""
    payload_bytes, pool = sum(tensor_bytes), _pool(files, tensor_bytes)
    tier = DiskTier(scratch, f"{payload_bytes:016x}", 1 << 62, payload_bytes)
    try:
        blocks = []
        for i in range(files):
            key = (None, (i, payload_bytes), ("read-probe",))
            block_hash = hash_block_key(key)
            tier.put(block_hash, key, os.urandom(payload_bytes))
            blocks.append((block_hash, key))
        cold = _load_all(tier, blocks, pool, cold=True)
        warm = _load_all(tier, blocks, pool, cold=False)
    finally:
        tier.close()
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


def measure_read(directory: Path, tensor_bytes: list[int], files: int = 64) -> dict:
    """``{"cold_bytes_per_s", "cold_file_s", "warm_bytes_per_s", "warm_file_s", "files",
    "payload_bytes"}`` of loading ``files`` block files of ``tensor_bytes`` (one block's bytes
    of each store tensor; and of an eighth of each) from ``directory``."""
    scratch = Path(directory) / f".read-probe.{os.getpid()}"
    payload_bytes = sum(tensor_bytes)
    small = [max(1, n // SMALL_FRACTION) for n in tensor_bytes]
    try:
        big_cold, big_warm = _per_file_seconds(scratch, files, tensor_bytes)
        small_cold, small_warm = _per_file_seconds(scratch, files, small)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    cold = _fit(payload_bytes, big_cold, sum(small), small_cold)
    warm = _fit(payload_bytes, big_warm, sum(small), small_warm)
    return {"cold_bytes_per_s": cold.bytes_per_s, "cold_file_s": cold.file_s,
            "warm_bytes_per_s": warm.bytes_per_s, "warm_file_s": warm.file_s,
            "files": files, "payload_bytes": payload_bytes}
