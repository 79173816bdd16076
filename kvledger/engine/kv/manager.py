"""KVCacheManager: which blocks each sequence holds (block tables over the BlockPool).

A running request's block table covers at least its computed tokens; ``allocate_slots`` grows it
so tokens ``[0, num_computed_tokens + num_new_tokens)`` have slots, all-or-nothing. At admission
a prefix-cache hit puts the hit blocks at the head of the table (a reference each, no copy: hit
blocks are full, so the request never writes into a shared block) and starts
``num_computed_tokens`` at the hit length. After the model ran, ``cache_full_blocks`` puts newly
sealed blocks in the prefix cache (full ones; a quantized format's window only once sealed). ``free`` drops the references tail-first (see pool.py for why).
The manager keeps no per-request state of its own: the block table and the count of blocks
already in the prefix cache live on the Request.

Retention: every request's ``retention`` (``engine/retention/interface.py``) says how many
physical slots its table covers (``Request.num_kv_slots``; the computed tokens under full
retention), how far its blocks may be hashed and hit in the prefix cache, and, after each step
(``retain``), which blocks go back to the pool (an evicting policy drops tokens and compacts,
``engine/retention/state.py``). A block in the cache always holds what full retention
computes, and a policy never writes into a block another sequence holds or the cache keeps.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from kvledger.engine.kv.events.recorder import CacheEvents
from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.kv.prefix import PrefixCache
from kvledger.engine.kv.store import KVStore
from kvledger.engine.kv.tiers.link import TierLink
from kvledger.engine.request import NULL_BLOCK, Request
from kvledger.ledger.kv_groups import KVGroup, first_live_block
from kvledger.spec import FULL

ONE_TABLE = (KVGroup(FULL, None, ()),)
"""The groups of a model of one kind as the manager sees them: one table, never dropped."""
log = logging.getLogger("kvledger.engine")


class KVCacheManager:
    """Block tables of requests over one BlockPool, with the prefix cache.

    Args:
        num_blocks: blocks in the pool (pages, one group's block each: ``ledger/kv_groups.py``).
        block_size: tokens per block.
        enable_prefix_caching: False disables hashing and hits.
        store: where retention compaction copies K/V, through ``copy_slots(src, dst)``: the
            KV store, or under tensor parallelism the runner that has every rank copy (None: no
            compaction).
        groups: the model's layer groups, one block table each (default: one full table).
        sealed_blocks: leading blocks of a sequence of n tokens that are final, the only ones
            the prefix cache shares (a quantized format's window is not; default: the full
            blocks, ``KVLayout.sealed_blocks``).
        shareable: leading blocks of a hit (block ids from position 0) that may be shared
            (a quantized format's whole key groups, ``QuantizedKVStore.shareable``; default:
            all).
        intact_blocks, max_cached_intact: a sequence's first blocks that stay at full
            precision (``KVFormatSpec.intact_blocks``), and how many of those the prefix
            cache may keep once free (the store's reserve of buffers for them); beyond that
            the least recently freed leaves the cache.
        on_release: the pool's hook for a block that keeps nothing (``BlockPool``); None =
            nothing.
        link_tiers: builds the KV tiers' link (``engine/kv/tiers/link.py``) over this
            manager's pool and prefix cache, which then write through to it; None = no tiers.
        events: the pool's KV events hook (``BlockPool``); None = none.
        state_slots: the state layers' slots (``engine/kv/state_store.py``): a request takes
            one at admission and gives it back with its blocks; None = no state layers.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 store: KVStore | None = None, groups: tuple[KVGroup, ...] = ONE_TABLE,
                 sealed_blocks: Callable[[int], int] | None = None,
                 shareable: Callable[[list[int]], int] = len,
                 intact_blocks: int = 0, max_cached_intact: int = 0,
                 on_release: Callable[[int], None] | None = None,
                 link_tiers: Callable[[BlockPool, PrefixCache], TierLink] | None = None,
                 events: CacheEvents | None = None,
                 state_slots=None):
        self.block_size = block_size
        self.state_slots = state_slots
        self.sealed_blocks = sealed_blocks or (lambda n: n // block_size)
        self.shareable = shareable
        self.intact_blocks, self.max_cached_intact = intact_blocks, max_cached_intact
        self._cached_intact: OrderedDict[int, None] = OrderedDict()  # free, cached, oldest first
        self.store = store
        self.groups = groups
        self.sliding = [i for i, g in enumerate(groups) if g.window is not None]
        self.pool = BlockPool(num_blocks, on_release, events)
        self.prefix = PrefixCache(self.pool, block_size, enable_prefix_caching, groups,
                                  self._write_through if link_tiers is not None else None)
        self.tiers = link_tiers(self.pool, self.prefix) if link_tiers is not None else None

    def _write_through(self, block_id: int, block_hash: bytes, key: tuple) -> None:
        """The prefix cache's ``on_cached``: a block entering the cache goes to the tiers."""
        self.tiers.write_through(block_id, block_hash, key)

    def _required_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_longest_cache_hit(self, req: Request) -> list[list[int]]:
        """Prefix-cache blocks ``req`` may start from, per group (only for a request holding
        no blocks): as many entries in every group, ``NULL_BLOCK`` before a sliding group's
        window. Sets ``req.missed_hit_tokens``; takes no references and counts nothing: pass
        the result to ``allocate_slots``. The hit covers ``len(result[0]) * block_size``
        tokens.
        """
        assert not req.block_table, "prefix lookup is for requests holding no blocks"
        req.missed_hit_tokens = 0
        if req.params.prompt_logprobs is not None:
            return [[] for _ in self.groups]  # every prompt position's logits are wanted
        # no further than a cold prefill of the request seals: the hit then reads what a
        # cold run reads (a quantized format's window is not in the cache anyway)
        limit = min(req.retention.hit_tokens(req.num_prompt_tokens) // self.block_size,
                    self.sealed_blocks(req.num_tokens))
        hits, missed = self.prefix.find_longest_cache_hit(req, limit)
        keep = self.shareable(hits[0])
        if self.state_slots is not None:  # a state model starts from a checkpoint's copy
            keep = min(keep, self.state_slots.restorable(hits[0]))
        if keep < len(hits[0]):  # a key group not whole, or no checkpoint: not shared
            missed += len(hits[0]) - keep
            hits = [h[:keep] for h in hits]
        req.missed_hit_tokens = missed * self.block_size
        if self.tiers is not None and self.prefix.enabled:  # one group: tiers refuse more
            most = min((req.num_tokens - 1) // self.block_size, limit)
            if len(hits[0]) < most:
                hits = [self.tiers.extend(req, hits[0], most)]  # continues into the KV tiers
                # intact blocks restored from a tier hold buffers like cached ones: counted
                # now (a lookup runs with a free sequence slot, whose reserve holds them),
                # trimmed to the cap at the next free
                for b in hits[0][: self.intact_blocks]:
                    if self._cached(b):
                        self._cached_intact.setdefault(b)
        return hits

    def blocks_needed(
        self, req: Request, num_new_tokens: int, hit: list[list[int]] | None = None
    ) -> tuple[int, int]:
        """(blocks ``req``'s tables gain, blocks taken off the free list) for this allocation.

        The two differ by the hit blocks that are already in use by another request (shared,
        they grow the tables but take nothing from the free list).
        """
        hit = hit or [[] for _ in self.groups]
        num_computed = req.num_kv_slots + len(hit[0]) * self.block_size
        required = self._required_blocks(num_computed + num_new_tokens)
        growth = new = revived = 0
        for table, hits in zip(self._tables(req), hit):
            added = max(0, required - max(len(table), len(hits)))
            live_hits = [b for b in hits if b != NULL_BLOCK]
            growth += added + len(live_hits)
            new += added
            revived += sum(1 for b in live_hits if self.pool.is_free(b))
        return growth, new + revived

    def tokens_that_fit(self, req: Request, n: int, free_blocks: int,
                        hit: list[list[int]] | None = None) -> int:
        """Most of the next ``n`` tokens of ``req`` (after ``hit``, at admission) that
        ``free_blocks`` can hold."""
        if len(self.groups) == 1 and not hit:
            slack = len(req.block_table) * self.block_size - req.num_kv_slots
            return max(0, min(n, slack + free_blocks * self.block_size))
        lo, hi = 0, n  # blocks_needed grows with the tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fits = self.blocks_needed(req, mid, hit)[1] <= free_blocks
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        return lo

    def allocate_slots(
        self, req: Request, num_new_tokens: int, hit: list[list[int]] | None = None
    ) -> bool:
        """Give ``req`` slots for its next ``num_new_tokens`` tokens in every group; all or
        nothing.

        With ``hit`` (admission of a request holding no blocks): take a reference on each hit
        block, put them first in the tables, set ``num_computed_tokens`` to the hit length
        and record the lookup in the prefix-cache counters.

        Returns:
            False, changing nothing, when the pool lacks free blocks.
        """
        _, from_free = self.blocks_needed(req, num_new_tokens, hit)
        if from_free > self.pool.num_free:
            return False
        if not req.block_table:
            hit = hit or [[] for _ in self.groups]
            hit_tokens = len(hit[0]) * self.block_size
            self.prefix.record(req, hit_tokens)
            for hits in hit:
                self.pool.touch(b for b in hits if b != NULL_BLOCK)
                for b in hits[: self.intact_blocks]:
                    self._cached_intact.pop(b, None)
            req.block_tables = [list(hits) for hits in hit]
            req.num_computed_tokens = hit_tokens
            req.num_hashed_blocks = len(hit[0])
            req.num_dropped_blocks = self._first_live(hit_tokens)
            req.retention.reset(hit_tokens)
            if self.state_slots is not None:
                req.state_slot = self.state_slots.allocate(hit[0][-1] if hit_tokens else None)
        required = self._required_blocks(req.num_kv_slots + num_new_tokens)
        for table in req.block_tables:
            table += self.pool.allocate(max(0, required - len(table)))
        req.peak_num_blocks = max(req.peak_num_blocks, req.num_blocks_held)
        return True

    def _tables(self, req: Request) -> list[list[int]]:
        """``req``'s block tables, one (empty) per group when it holds no blocks."""
        return req.block_tables if req.block_table else [[] for _ in self.groups]

    def _first_live(self, num_tokens: int) -> int:
        """First block the sliding groups still hold at ``num_tokens`` (0 without any)."""
        if not self.sliding:
            return 0
        return first_live_block(self.groups[self.sliding[0]], num_tokens, self.block_size)

    def cache_full_blocks(self, req: Request) -> None:
        """Put the sealed blocks of ``req``'s computed tokens in the prefix cache (after
        compute)."""
        limit = min(req.retention.shareable_tokens(req.num_prompt_tokens) // self.block_size,
                    self.sealed_blocks(req.num_computed_tokens))
        req.num_hashed_blocks = self.prefix.cache_full_blocks(req, req.num_hashed_blocks, limit)

    def _cached(self, block_id: int) -> bool:
        return self.pool.is_free(block_id) and self.pool.blocks[block_id].block_hash is not None

    def _cache_intact(self, blocks: list[int]) -> None:
        """Intact blocks ``blocks`` were freed: those still in the prefix cache keep their
        full-precision buffers, at most ``max_cached_intact`` (the others, least recently
        freed first, are evicted, which gives their buffers back)."""
        for b in blocks:
            if b != NULL_BLOCK and self._cached(b):
                self._cached_intact[b] = None
                self._cached_intact.move_to_end(b)
        if len(self._cached_intact) > self.max_cached_intact:
            for b in [b for b in self._cached_intact if not self._cached(b)]:
                del self._cached_intact[b]  # reused, or evicted by the pool since
        while len(self._cached_intact) > self.max_cached_intact:
            b, _ = self._cached_intact.popitem(last=False)
            self.pool.evict(b)

    def retain(self, req: Request) -> None:
        """After a step of ``req``: give back (or compact) the blocks its retention frees
        (none under full retention), and the sliding groups' blocks that left their window
        (to the pool as evictable cached blocks when hashed)."""
        req.block_table = req.retention.retain(req.block_table, req.num_computed_tokens,
                                               req.num_prompt_tokens, self.pool, self.store)
        first = self._first_live(req.num_computed_tokens)
        if first > req.num_dropped_blocks:
            for g in self.sliding:
                table = req.block_tables[g]
                dropped = table[req.num_dropped_blocks:first]
                self.pool.free(reversed([b for b in dropped if b != NULL_BLOCK]))
                table[req.num_dropped_blocks:first] = [NULL_BLOCK] * len(dropped)
            req.num_dropped_blocks = first

    def trim(self, req: Request) -> None:
        """Give back the blocks past ``req``'s KV slots, tail first: what a speculative verify
        allocated for proposed tokens that were rejected (never hashed: they were not
        computed tokens)."""
        keep = self._required_blocks(req.num_kv_slots)
        for table in req.block_tables:
            self.pool.free(b for b in reversed(table[keep:]) if b != NULL_BLOCK)
            del table[keep:]

    def free(self, req: Request) -> None:
        """Drop ``req``'s references tail-first and empty its block tables."""
        for table in req.block_tables:
            self.pool.free(b for b in reversed(table) if b != NULL_BLOCK)
        if self.intact_blocks:
            self._cache_intact([b for t in req.block_tables for b in t[: self.intact_blocks]])
        req.block_tables = [[] for _ in self.groups]
        if req.state_slot is not None:
            self.state_slots.free(req.state_slot)
            req.state_slot = None
        req.num_hashed_blocks = 0
        req.num_dropped_blocks = 0
        req.retention.reset()
