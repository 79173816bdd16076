"""TierLink: the pool's prefix cache continued into the tier chain, and its write-through.

``extend``: where a request's prefix lookup stops in the pool, the following blocks are looked
up in the tiers' indexes; if the ledger predicts loading them is faster than prefilling their
tokens (:class:`LoadPolicy`), they are read, copied into freshly allocated pool blocks and
cached there, then freed as *evictable*, so the scheduler's usual hit path takes them (the
admission rule and the pool size do not change). The blocks already hit are pinned meanwhile so
the allocation cannot evict them. Each loaded block's tier is remembered on the request
(``Request.tier_blocks``) for ``cached_tokens_by_tier``. With keys grouped over k blocks the
blocks are loaded and shared in whole key groups, each restored only when its blocks' group
tags agree (``payload.py``); a quantized format's intact blocks are restored into residual
buffers. ``write_through``: a block entering the prefix cache is copied out and offered to the
chain's writer, unless every tier has it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.kv.prefix import PrefixCache
from kvledger.engine.kv.tiers.chain import TierChain
from kvledger.engine.kv.tiers.payload import payload_bytes, read_block, whole_groups, write_blocks
from kvledger.engine.request import Request
from kvledger.ledger.tier_load import ReadSpeed, recompute_seconds
from kvledger.spec import ModelSpec


@dataclass(frozen=True)
class LoadPolicy:
    """Load or recompute, from the speeds ``kvledger probe --kv-disk-dir`` measured and the
    ledger's formulas (:mod:`kvledger.ledger.tier_load`). While a speed is unknown nothing can
    be predicted, and blocks are always loaded.

    Attributes:
        cold: the tier's read speed with the page cache dropped (None: unknown).
        warm: its read speed from the page cache (None: ``cold`` is used for every block).
        prefill_flops_per_s: the engine's prefill speed (None: unknown).
        spec, params_active: the model, for the prefill FLOPs of the tokens.
    """

    cold: ReadSpeed | None = None
    warm: ReadSpeed | None = None
    prefill_flops_per_s: float | None = None
    spec: ModelSpec | None = None
    params_active: int = 0

    def load_seconds(self, block_bytes: int, warm_blocks: int, cold_blocks: int) -> float | None:
        """Predicted seconds to load blocks of ``block_bytes`` payload bytes, ``warm_blocks``
        of them in the page cache (or another RAM tier) and ``cold_blocks`` not."""
        if self.cold is None:
            return None
        warm = self.warm or self.cold
        return (warm.seconds(warm_blocks * block_bytes, warm_blocks)
                + self.cold.seconds(cold_blocks * block_bytes, cold_blocks))

    def recompute_seconds(self, start: int, end: int) -> float | None:
        """Predicted seconds to prefill tokens ``[start, end)`` again."""
        if not self.prefill_flops_per_s or self.spec is None:
            return None
        return recompute_seconds(self.spec, self.params_active, start, end,
                                 self.prefill_flops_per_s)

    @staticmethod
    def loads(load_s: float | None, recompute_s: float | None) -> bool:
        """Load unless both are predicted and the recompute is faster."""
        return load_s is None or recompute_s is None or load_s < recompute_s


class TierLink:
    """Joins one pool, its prefix cache and its KV store to a tier chain.

    Args:
        chain: the tiers.
        pool, prefix, store: the engine's block pool, prefix cache and KV store.
        block_size: tokens per block.
        policy: load or recompute.
        chunk_tokens: most tokens one step prefills for a request (``max_num_batched_tokens``).
    """

    def __init__(self, chain: TierChain, pool: BlockPool, prefix: PrefixCache, store,
                 block_size: int, policy: LoadPolicy, chunk_tokens: int) -> None:
        self.chain, self.pool, self.prefix, self.store = chain, pool, prefix, store
        self.block_size, self.policy = block_size, policy
        self.chunk_tokens = chunk_tokens
        self.recomputed_blocks = 0  # found in a tier, recomputed because loading was slower
        self.deferred_loads = 0  # tier hits not loaded: the request could not run yet

    def stats(self) -> dict:
        """``kv_tiers`` (tier name -> its ``TierStats`` as a dict), the chain's
        ``kv_tier_dropped_writes`` / ``kv_tier_offered_writes``, ``kv_tier_recomputed_blocks``
        (found in a tier, recomputed because the ledger predicted loading slower) and
        ``kv_tier_deferred_loads`` (tier hits not loaded: the pool could not hold the request
        yet)."""
        return {"kv_tiers": {t.name: asdict(t.stats) for t in self.chain.tiers},
                "kv_tier_dropped_writes": self.chain.dropped_writes,
                "kv_tier_offered_writes": self.chain.offered_writes,
                "kv_tier_recomputed_blocks": self.recomputed_blocks,
                "kv_tier_deferred_loads": self.deferred_loads}

    def write_through(self, block_id: int, block_hash: bytes, key: tuple) -> None:
        if self.chain.wants(block_hash, key):
            self.chain.offer(block_hash, key, read_block(self.store, block_id))

    def extend(self, req: Request, hits: list[int], limit: int) -> list[int]:
        """``hits`` (pool block ids of ``req``'s prefix) followed by the blocks loaded from the
        tiers, at most ``limit`` in all.

        Nothing is loaded unless the free list holds what admitting ``req`` then takes (the
        free hits it revives, the loaded blocks and those of its first chunk, at most
        ``chunk_tokens``): a request that must wait would see the blocks loaded for it evicted
        before its turn, and load them again at its next admission attempt."""
        found = []
        for i in range(len(hits), limit):
            block_hash, key = self.prefix.block_hash(req, i)
            tier = self.chain.find(block_hash, key)
            if tier is None:
                break
            found.append((block_hash, key, tier))
        found = found[:whole_groups(self.store, len(hits), len(found))]
        if not found:
            return hits
        rest = req.num_tokens - (len(hits) + len(found)) * self.block_size
        chunk_blocks = -(-min(rest, self.chunk_tokens) // self.block_size)
        if sum(map(self.pool.is_free, hits)) + len(found) + chunk_blocks > self.pool.num_free:
            self.deferred_loads += 1
            return hits
        predicted = None
        if self.policy.cold is not None:
            warm = sum(tier.warm(block_hash) for block_hash, _, tier in found)
            size = sum(payload_bytes(self.store, len(hits) + i)
                       for i in range(len(found))) // len(found)
            predicted = self.policy.load_seconds(size, warm, len(found) - warm)
        recompute = self.policy.recompute_seconds(len(hits) * self.block_size,
                                                  (len(hits) + len(found)) * self.block_size)
        if not self.policy.loads(predicted, recompute):
            self.recomputed_blocks += len(found)
            return hits
        start = time.perf_counter()
        self.pool.touch(hits)  # pinned: the allocation below must not evict them
        fresh = self.pool.allocate(len(found))
        payloads = []
        for block_hash, key, tier in found:
            payload = self.chain.load(tier, block_hash, key)
            if payload is None:
                break
            payloads.append(payload)
        restored = write_blocks(self.store, fresh[:len(payloads)], payloads, len(hits))
        loaded = []
        for block_id, (block_hash, key, tier) in zip(fresh[:restored], found):
            if not self.pool.cache_block(block_id, block_hash, key):
                break
            req.tier_blocks[block_hash] = tier.name
            loaded.append(block_id)
        # whole key groups only: a group cut short by a block the pool caches already is
        # not shared (its cached blocks stay, and a pool hit refuses them as not whole)
        loaded = loaded[:whole_groups(self.store, len(hits), len(loaded))]
        self.pool.free(reversed(fresh))  # loaded blocks stay cached (evictable)
        self.pool.free(reversed(hits))
        req.tier_load_s += time.perf_counter() - start
        if predicted is not None:
            req.tier_load_predicted_s += predicted
        return hits + loaded
