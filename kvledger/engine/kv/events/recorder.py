"""The hooks the pool and the KV tiers report through, and their reports as vLLM events.

A pool or tier is given a :class:`CacheEvents` at construction; it calls ``stored(hash, key)``
when a block becomes findable there (a pool block entering the prefix cache, a tier's block
written) and ``removed(hash)`` when it stops being (evicted, dropped, reset). Each call is one
``put`` on the shared :class:`EventQueue` (the wall-clock time, what, where): the conversion to
vLLM's events happens on the publisher thread (:func:`to_events`), off the engine's path. A
block that never entered the cache (a rejected speculative token, an unfinished block, a tier
write that failed) is never reported.

Mediums as vLLM names them: the pool is ``GPU`` (vLLM's ``MEDIUM_GPU``, the engine's own KV
pool, whatever device holds it), the RAM tier ``CPU`` (the offloading connector's
``CPULoadStoreSpec``), the disk tier ``STORAGE`` (its storage tier's ``StorageLoadStoreSpec``).
"""

from __future__ import annotations

import queue
import time

from kvledger.engine.kv.events.wire import event, external_hash
from kvledger.ledger.kv_groups import KVGroup

MEDIUMS = {"pool": "GPU", "ram": "CPU", "disk": "STORAGE"}
STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"


class EventQueue:
    """What the hooks report, in order, for the publisher thread; ``put`` blocks when
    ``max_size`` reports wait (as vLLM's publisher queue does: nothing is lost)."""

    def __init__(self, max_size: int) -> None:
        self._queue: queue.Queue = queue.Queue(max_size)

    def put(self, item) -> None:
        self._queue.put(item)

    def get(self, timeout: float):
        """The next report, or None after ``timeout`` seconds (``queue.Empty`` inside)."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def done(self, n: int) -> None:
        """``n`` reports taken are published (:meth:`join` waits for every one)."""
        for _ in range(n):
            self._queue.task_done()

    def join(self) -> None:
        self._queue.join()

    def drain(self, limit: int) -> list:
        """Up to ``limit`` reports already waiting, without blocking."""
        out = []
        while len(out) < limit:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return out


class CacheEvents:
    """The hook of one medium (``MEDIUMS``): what enters and leaves it."""

    def __init__(self, sink: EventQueue, medium: str) -> None:
        self.sink, self.medium = sink, medium

    def stored(self, block_hash, key: tuple) -> None:
        """``block_hash`` (a pool key: bytes, or (group, bytes)) stored under ``key``
        (parent hash, token ids, extra keys)."""
        self.sink.put((time.time(), STORED, self.medium, block_hash, key))

    def removed(self, block_hash) -> None:
        self.sink.put((time.time(), REMOVED, self.medium, block_hash, None))

    def cleared(self) -> None:
        """Everything this replica held is gone (sent at start: a restarted replica)."""
        self.sink.put((time.time(), CLEARED, self.medium, None, None))


def to_events(items: list, block_size: int, groups: tuple[KVGroup, ...],
              array_like: bool) -> list:
    """vLLM's events for reports ``items`` in order; consecutive reports of one chain (same
    medium and group, each block's parent the previous one) share one ``BlockStored``, and
    consecutive removals of one medium and group one ``BlockRemoved``."""
    merged: list[tuple[str, dict]] = []
    for _, what, medium, pool_key, key in items:
        if what == CLEARED:
            merged.append((CLEARED, {}))
            continue
        group, digest = pool_key if isinstance(pool_key, tuple) else (0, pool_key)
        last = merged[-1] if merged else None
        same = (last is not None and last[0] == what and last[1]["medium"] == medium
                and last[1]["group_idx"] == group)
        if what == REMOVED:
            if same:
                last[1]["block_hashes"].append(external_hash(digest))
            else:
                merged.append((REMOVED, {"block_hashes": [external_hash(digest)],
                                         "medium": medium, "group_idx": group}))
            continue
        parent, tokens, extra = key
        if same and last[1]["_last"] == parent:
            fields = last[1]
            fields["block_hashes"].append(external_hash(digest))
            fields["token_ids"].extend(tokens)
            fields["extra_keys"].append(tuple(extra) or None)
            fields["_last"] = digest
            continue
        window = groups[group].window if group < len(groups) else None
        merged.append((STORED, {
            "block_hashes": [external_hash(digest)],
            "parent_block_hash": None if parent is None else external_hash(parent),
            "token_ids": list(tokens), "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": None, "extra_keys": [tuple(extra) or None],
            "group_idx": group,
            "kv_cache_spec_kind": "full_attention" if window is None else "sliding_window",
            "kv_cache_spec_sliding_window": window, "_last": digest}))
    return [event(tag, fields, array_like) for tag, fields in merged]
