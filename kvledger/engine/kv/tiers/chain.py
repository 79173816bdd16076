"""TierChain: the KV tiers below the pool, fastest first, and the writer that fills them.

Write-through: when a full block enters the prefix cache the engine thread copies its payload
and offers it (:meth:`TierChain.offer`); a writer thread puts it in every tier that lacks it.
The queue between them is bounded in bytes: when it is full the block is dropped and counted
(``dropped_writes``) rather than stalling the engine. A lookup (:meth:`find`) asks the tiers in
order; :meth:`load` reads a block from the tier that has it and times the read.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from kvledger.engine.kv.tiers.tier import KVTier

log = logging.getLogger("kvledger.kv_tier")
DEFAULT_QUEUE_BYTES = 256 << 20


class TierChain:
    """Tiers in lookup order and their write-through queue.

    Args:
        tiers: fastest first (``ram`` before ``disk``).
        queue_bytes: most payload bytes waiting to be written; more are dropped.
    """

    def __init__(self, tiers: list[KVTier], queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        self.tiers = tiers
        self.queue_bytes = queue_bytes
        self.queued_bytes = 0
        self.offered_writes = 0
        self.dropped_writes = 0
        self._queue: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer",
                                        daemon=True)
        self._writer.start()

    def find(self, block_hash: bytes, key: tuple) -> KVTier | None:
        """The first tier holding the block under ``key`` (index lookups only)."""
        for tier in self.tiers:
            if tier.contains(block_hash, key):
                return tier
            tier.stats.misses += 1
        return None

    def load(self, tier: KVTier, block_hash: bytes, key: tuple) -> bytearray | memoryview | None:
        """The block's verified payload from ``tier``, or None (counted by the tier)."""
        start = time.perf_counter()
        payload = tier.get(block_hash, key)
        tier.stats.load_seconds += time.perf_counter() - start
        if payload is not None:
            tier.stats.hits += 1
        return payload

    def wants(self, block_hash: bytes, key: tuple) -> bool:
        """True when some writable tier lacks the block (so it is worth copying out)."""
        return any(not t.stats.disabled and not t.contains(block_hash, key) for t in self.tiers)

    def offer(self, block_hash: bytes, key: tuple, payload: bytes) -> bool:
        """Queue a block for the writer; False (and counted) when the queue is full."""
        self.offered_writes += 1
        with self._cond:
            if self.queued_bytes + len(payload) > self.queue_bytes:
                self.dropped_writes += 1
                return False
            self.queued_bytes += len(payload)
        self._queue.put((block_hash, key, payload))
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            block_hash, key, payload = item
            for tier in self.tiers:
                try:
                    tier.put(block_hash, key, payload)
                except Exception:  # a tier bug must not kill the writer: log it, go on
                    tier.stats.write_errors += 1
                    log.exception("KV tier %s: write failed", tier.name)
            with self._cond:
                self.queued_bytes -= len(payload)
            self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block is written (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the writer and close the tiers."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        for tier in self.tiers:
            tier.close()
