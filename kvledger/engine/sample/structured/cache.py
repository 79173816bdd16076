"""GrammarCache: compiled constraints kept within a byte budget, fair between tenants.

Each entry is the future of one compiled constraint, keyed by ``StructuredOutputsParams.key``,
owned by the tenant whose request compiled it and sized once compiled (the compiler's estimate
of its memory). While the entries' bytes exceed the budget, the least recently used entry of
the tenant holding the most bytes goes: a tenant that sends many large constraints evicts its
own first, never the few entries of the others. A constraint that failed to compile is never
kept (the next request compiles it again and gets the same error).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Entry:
    future: concurrent.futures.Future
    tenant: str | None
    nbytes: int = 0


class GrammarCache:
    """LRU of compiled constraints bounded by ``budget_bytes``; thread-safe.

    Args:
        budget_bytes: most bytes the entries may hold together.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_start(self, key: str, tenant: str | None, start) -> concurrent.futures.Future:
        """The cached future of ``key`` (now the most recently used), else ``start()``'s,
        kept under ``tenant`` until it fails or is evicted."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry.future
            future = start()
            self._entries[key] = _Entry(future, tenant)
        future.add_done_callback(lambda done: self._settle(key, done))
        return future

    def set_size(self, key: str, future: concurrent.futures.Future, nbytes: int) -> None:
        """Record the bytes of ``key``'s compiled form, then evict down to the budget."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.future is future:
                entry.nbytes = nbytes
                self._evict()

    def discard(self, key: str) -> None:
        """Forget ``key`` (no-op when it is not kept)."""
        with self._lock:
            self._entries.pop(key, None)

    @property
    def nbytes(self) -> int:
        """Bytes the entries hold."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def _settle(self, key: str, future: concurrent.futures.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry.future is future:
                    del self._entries[key]

    def _evict(self) -> None:
        by_tenant: dict[str | None, int] = {}
        for entry in self._entries.values():
            by_tenant[entry.tenant] = by_tenant.get(entry.tenant, 0) + entry.nbytes
        total = sum(by_tenant.values())
        while total > self.budget_bytes:
            heaviest = max(by_tenant, key=by_tenant.__getitem__)
            key = next(k for k, e in self._entries.items() if e.tenant == heaviest and e.nbytes)
            nbytes = self._entries.pop(key).nbytes
            by_tenant[heaviest] -= nbytes
            total -= nbytes
