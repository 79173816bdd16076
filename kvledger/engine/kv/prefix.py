"""Prefix cache: reuse the KV of full blocks whose whole token prefix was computed before.

Each FULL block i of a request gets a chained hash

    h_i = sha256(repr((h_{i-1}, tuple(tokens of block i), extra_keys_i)))

with ``h_{-1} = None`` and ``extra_keys_0 = (cache_salt,)`` when the request has a salt (later
blocks inherit the salt through the chain), else ``()``. Because the hash covers the parent, equal
``h_i`` means equal tokens for the whole prefix ``[0, (i+1) * block_size)``, which is what makes
the block's K/V (a function of every earlier token through attention) reusable. sha256 over
``repr`` is stable across processes (unlike Python's salted ``hash`` of str); a hit is still
verified by comparing the stored key (parent hash, token ids, extra keys) with the querying
request's, so a collision can never hand out wrong K/V.

A hit is capped at ``(num_tokens - 1) // block_size`` blocks so at least one token is always
computed: the forward pass of the last token yields the logits to sample from. Prompt blocks and
full blocks of generated tokens both enter the cache once their K/V is computed. Counters, as
vLLM counts them: each request's prompt tokens are queried once, at its first admission, and its
hit tokens counted then (``queried_tokens``, ``hit_tokens``: the hit rate of prompts); the
lookups of a re-admission after a preemption (prompt + output so far) are counted apart
(``requeried_tokens``, ``rehit_tokens``). With ``enabled=False`` nothing is hashed, looked up
or counted.

Layer groups (``ledger/kv_groups.py``): each group's block i is cached on its own, under
``h_i`` in the first group and ``(g, h_i)`` in group g (the pool's keys are opaque), so a model
of one kind keys its blocks exactly as before. A hit is the longest prefix of L blocks for
which every group holds what the next token needs (vLLM's hybrid rule): each full group blocks
0 .. L-1, each sliding group the blocks of positions ``max(0, L*B - W + 1) .. L*B - 1``.
Nothing is recomputed to make a hit. When the full groups held more than the hit taken (a
sliding group's blocks were evicted), the tokens lost are counted in ``missed_tokens`` and
logged.

Words: a block is *cached* when it is in the prefix cache (hash-addressable, in use or free);
a free cached block is *evictable*; a request's ``num_cached_tokens`` are the tokens it took from
the cache. The hash -> block map lives in the BlockPool (eviction happens there); this module
computes hashes and decides hits.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable

from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.request import NULL_BLOCK, Request
from kvledger.ledger.kv_groups import KVGroup, first_live_block
from kvledger.spec import FULL

log = logging.getLogger("kvledger.engine")


def block_hash_key(parent: bytes | None, token_ids: list[int], extra_keys: tuple) -> tuple:
    """What a block's hash is computed from: (parent hash, token ids, extra keys)."""
    return (parent, tuple(token_ids), extra_keys)


def hash_block_key(key: tuple) -> bytes:
    """sha256 digest (32 bytes) of a block hash key; stable across processes."""
    return hashlib.sha256(repr(key).encode()).digest()


class PrefixCache:
    """Chained block hashes, longest-hit lookup with verification, and hit counters.

    Args:
        pool: the block pool holding the hash -> block map.
        block_size: tokens per block.
        enabled: False turns the prefix cache off (``--no-prefix-caching``).
        groups: the model's layer groups (default: one full group).
        on_cached: called with (block id, hash, key) when a block enters the cache (a KV
            tier's write-through: engine/kv/tiers/link.py); None = nothing.
    """

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool = True,
                 groups: tuple[KVGroup, ...] = (KVGroup(FULL, None, ()),),
                 on_cached: Callable[[int, bytes, tuple], None] | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.groups = groups
        self.missed_tokens = 0
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.requeried_tokens = 0
        self.rehit_tokens = 0
        self.on_cached = on_cached

    def _key(self, req: Request, index: int) -> tuple:
        """Hash key of full block ``index`` of ``req`` (needs the parent's hash)."""
        bs = self.block_size
        parent = req.block_hashes[index - 1] if index > 0 else None
        extra = (req.cache_salt,) if index == 0 and req.cache_salt is not None else ()
        return block_hash_key(parent, req.token_ids_range(index * bs, (index + 1) * bs), extra)

    def block_hash(self, req: Request, index: int) -> tuple[bytes, tuple]:
        """(hash, key) of full block ``index``; blocks are hashed in order and memoized in
        ``req.block_hashes``.

        Raises:
            AssertionError: the block is not full, or an earlier block was never hashed.
        """
        assert (index + 1) * self.block_size <= req.num_tokens, f"block {index} is not full"
        assert index <= len(req.block_hashes), "blocks are hashed in order"
        key = self._key(req, index)
        if index == len(req.block_hashes):
            req.block_hashes.append(hash_block_key(key))
        return req.block_hashes[index], key

    @staticmethod
    def _pool_key(group: int, block_hash: bytes):
        return block_hash if group == 0 else (group, block_hash)

    def _cached(self, req: Request, group: int, index: int) -> int | None:
        """Block id of group ``group``'s block ``index`` of ``req`` in the cache, verified."""
        block_hash, key = self.block_hash(req, index)
        block = self.pool.lookup(self._pool_key(group, block_hash))
        return None if block is None or block.hash_key != key else block.block_id

    def find_longest_cache_hit(self, req: Request, limit: int | None = None
                               ) -> tuple[list[list[int]], int]:
        """(block ids per group of the longest verified hit, blocks the full groups held
        beyond it); no references taken.

        At most ``(req.num_tokens - 1) // block_size`` blocks (and ``limit``). Each group's
        list has the hit's length, ``NULL_BLOCK`` before a sliding group's window. Does not
        touch the counters: call ``record`` when the hit is actually used.
        """
        most = (req.num_tokens - 1) // self.block_size
        most = most if limit is None else min(most, limit)
        if not self.enabled or most <= 0:
            return [[] for _ in self.groups], 0
        found = [[] for _ in self.groups]  # per group, block id or None per index
        full = [g for g, grp in enumerate(self.groups) if grp.window is None]
        reach = most  # the full groups' longest hit
        for i in range(most):
            ids = [self._cached(req, g, i) for g in full]
            if None in ids:
                reach = i
                break
            for g, block_id in zip(full, ids):
                found[g].append(block_id)
        sliding = [g for g in range(len(self.groups)) if g not in full]
        for g in sliding:
            found[g] = [self._cached(req, g, i) for i in range(reach)]
        hit = reach
        while hit > 0 and not all(self._window_held(found[g], g, hit) for g in sliding):
            hit -= 1
        tables = []
        for g, ids in enumerate(found):
            first = first_live_block(self.groups[g], hit * self.block_size, self.block_size)
            tables.append([NULL_BLOCK] * first + ids[first:hit])
        return tables, reach - hit if full else 0

    def _window_held(self, ids: list[int | None], group: int, hit: int) -> bool:
        """True when a sliding group holds the blocks the token after ``hit`` blocks sees."""
        first = first_live_block(self.groups[group], hit * self.block_size, self.block_size)
        return None not in ids[first:hit]

    def record(self, req: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup of ``req`` with ``num_hit_tokens`` reused: its prompt
        at the first admission, its whole length (apart) at a re-admission."""
        if not self.enabled:
            return
        if req.num_preemptions == 0:
            self.queried_tokens += req.num_prompt_tokens
            self.hit_tokens += min(num_hit_tokens, req.num_prompt_tokens)
            if req.missed_hit_tokens:
                self.missed_tokens += req.missed_hit_tokens
                log.info("prefix cache: request %s hit %d tokens, not %d: a sliding window "
                         "layer group's blocks were evicted", req.request_id, num_hit_tokens,
                         num_hit_tokens + req.missed_hit_tokens)
        else:
            self.requeried_tokens += req.num_tokens
            self.rehit_tokens += num_hit_tokens

    def cache_full_blocks(self, req: Request, num_done: int, limit: int | None = None) -> int:
        """Register ``req``'s full, computed blocks from index ``num_done`` on (at most
        ``limit`` leading blocks in all: a retention policy's shareable blocks).

        Returns:
            The number of leading blocks of ``req.block_table`` now registered (pass it back as
            ``num_done`` next time).
        """
        num_full = req.num_computed_tokens // self.block_size
        if limit is not None:
            num_full = min(num_full, limit)
        if not self.enabled or num_full <= num_done:
            return num_done
        for i in range(num_done, num_full):
            block_hash, key = self.block_hash(req, i)
            for g, table in enumerate(req.block_tables):
                if table[i] == NULL_BLOCK:
                    continue
                cached = self.pool.cache_block(table[i], self._pool_key(g, block_hash), key)
                if cached and self.on_cached is not None:  # tiers run on one-group layouts
                    self.on_cached(table[i], block_hash, key)
        return num_full
