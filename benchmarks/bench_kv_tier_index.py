"""Start-up of a full disk KV tier: how long rebuilding the index of ``--gib`` GiB of block
files takes (issue 39), page cache warm and dropped.

Fills a tier directory with block files of the bundled model's bf16 block size (368,640
payload bytes per 16-token block; random payloads, valid headers, written without fsync: the
fill is not what is measured), then times ``DiskTier`` construction (which reads each file's
header only) with the files' pages in the page cache and after ``posix_fadvise(DONTNEED)`` on
every file. Run it alone (flock + quiet.sh); it needs ``--gib`` GiB of free disk.

    python benchmarks/bench_kv_tier_index.py [--gib 10] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench_kv_tier_restart import drop_page_cache
from common import machine_line

PAYLOAD = 368_640  # SmolLM2-135M bf16: 30 layers x 2 x 3 heads x 64 x 2 bytes x 16 tokens
FP = "b1" * 32


def fill(root: Path, gib: float) -> int:
    from kvledger.engine.kv.prefix import block_hash_key, hash_block_key
    from kvledger.engine.kv.tiers import block_file
    from kvledger.engine.kv.tiers.disk import DiskTier

    tier = DiskTier(root, FP, int(gib * (1 << 30)), PAYLOAD)
    payload = os.urandom(PAYLOAD)
    parent, n, total = None, 0, 0
    while True:
        key = block_hash_key(parent, list(range(n * 16, n * 16 + 16)), ())
        h = hash_block_key(key)
        data = block_file.encode(FP, h, key, payload)
        if total + len(data) > gib * (1 << 30):
            return n
        path = tier.path(h)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(data)
        parent, n, total = h, n + 1, total + len(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=10.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    from kvledger.engine.kv.tiers.disk import DiskTier

    root = Path(args.dir or tempfile.mkdtemp(prefix="kv-tier-index-"))
    start = time.perf_counter()
    n = fill(root, args.gib)
    print(machine_line(os.cpu_count()))
    print(f"filled {n} block files ({args.gib} GiB) in {time.perf_counter() - start:.1f} s")
    for label in ("page cache warm", "page cache dropped", "page cache warm"):
        if label.endswith("dropped"):
            drop_page_cache(root)
        tier = DiskTier(root, FP, int(args.gib * (1 << 30)) + (1 << 20), PAYLOAD)
        assert tier.stats.blocks == n and tier.stats.corrupt_files == 0
        print(f"  index rebuild, {label:18s} {tier.rebuild_seconds:7.2f} s for {n} files")
    if not args.keep:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
