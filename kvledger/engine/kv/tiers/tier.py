"""The KV tier interface: a store of full KV blocks below the pool, addressed by block hash.

The engine keeps a chain of tiers (``chain.py``), fastest first: on the CPU a host-RAM tier
(``ram.py``) and a disk tier (``disk.py``); a GPU device would put host RAM between its pool and
disk. A tier holds a block's payload (the store's bytes of one block: ``payload.py``) under its
chained prefix hash and the hash key, and answers a lookup only when the stored key equals the
querying request's (as the pool does for an in-memory hit). Tiers are called from the engine
thread (``contains``, ``get``) and the chain's writer thread (``put``): they lock their index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

TIER_NAMES = ("pool", "ram", "disk")
"""Where a request's cached tokens come from (``cached_tokens_by_tier``)."""


@dataclass
class TierStats:
    """Counters of one tier (Prometheus: ``kvledger_kv_tier_*{tier=...}``).

    Blocks are counted, bytes are payload bytes; ``load_seconds`` is the time ``get`` took
    (read, checks, copy out)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0
    corrupt_files: int = 0
    write_errors: int = 0
    blocks: int = 0
    bytes_held: int = 0
    capacity_bytes: int = 0
    disabled: bool = False


class KVTier(Protocol):
    """One tier of the chain."""

    name: str
    stats: TierStats

    def contains(self, block_hash: bytes, key: tuple) -> bool:
        """True when the tier holds ``block_hash`` stored under ``key`` (index only, no I/O)."""

    def warm(self, block_hash: bytes) -> bool:
        """True when loading the block would not wait for a device (held in RAM, or its file's
        pages are in the page cache): the load is predicted at the warm read speed."""

    def get(self, block_hash: bytes, key: tuple) -> bytearray | memoryview | None:
        """The verified payload (writable), or None (absent, or failed a check: then dropped and counted
        in ``corrupt_files``)."""

    def put(self, block_hash: bytes, key: tuple, payload: bytes) -> None:
        """Store a block, evicting least-recently-used ones to stay within the capacity; errors
        are counted (and a full disk turns the tier off), never raised."""

    def close(self) -> None:
        """Release what the tier holds open."""


def cached_by_tier(req, num_hit_blocks: int, block_size: int) -> dict[str, int]:
    """``{"pool": n, "ram": n, "disk": n}``: the tokens of ``req``'s first ``num_hit_blocks``
    blocks by where each came from (``req.tier_blocks``; the pool when not loaded from a tier);
    they sum to the hit's tokens."""
    out = dict.fromkeys(TIER_NAMES, 0)
    for block_hash in req.block_hashes[:num_hit_blocks]:
        out[req.tier_blocks.get(block_hash, "pool")] += block_size
    return out
