"""RAMTier: full KV blocks in host memory, least recently used evicted first.

On the CPU device the pool itself is host memory, so this tier only holds blocks the pool has
evicted; it exists so that the chain is real and tested (a GPU device puts it between its pool
and the disk tier).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvledger.engine.kv.events.recorder import CacheEvents
from kvledger.engine.kv.tiers.tier import TierStats


class RAMTier:
    """Blocks in an LRU map of at most ``capacity_bytes`` payload bytes; ``events`` is told
    each block put (``stored``) and evicted (``removed``), None = nothing."""

    name = "ram"

    def __init__(self, capacity_bytes: int, events: CacheEvents | None = None) -> None:
        self.events = events
        self.stats = TierStats(capacity_bytes=capacity_bytes)
        self._blocks: OrderedDict[bytes, tuple[tuple, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def contains(self, block_hash: bytes, key: tuple) -> bool:
        with self._lock:
            entry = self._blocks.get(block_hash)
        return entry is not None and entry[0] == key

    def warm(self, block_hash: bytes) -> bool:
        return True

    def get(self, block_hash: bytes, key: tuple) -> bytearray | None:
        with self._lock:
            entry = self._blocks.get(block_hash)
            if entry is None or entry[0] != key:
                return None
            self._blocks.move_to_end(block_hash)
        self.stats.bytes_read += len(entry[1])
        return bytearray(entry[1])

    def put(self, block_hash: bytes, key: tuple, payload: bytes) -> None:
        s = self.stats
        if len(payload) > s.capacity_bytes:
            return
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return
            victims = []
            while s.bytes_held + len(payload) > s.capacity_bytes:
                old_hash, (_, old) = self._blocks.popitem(last=False)
                s.bytes_held -= len(old)
                victims.append(old_hash)
            self._blocks[block_hash] = (key, bytes(payload))
            s.bytes_held += len(payload)
            s.blocks = len(self._blocks)
        s.bytes_written += len(payload)
        if self.events is not None:
            for old_hash in victims:
                self.events.removed(old_hash)
            self.events.stored(block_hash, key)

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.stats.blocks = self.stats.bytes_held = 0
