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

Words: a block is *cached* when it is in the prefix cache (hash-addressable, in use or free);
a free cached block is *evictable*; a request's ``num_cached_tokens`` are the tokens it took from
the cache. The hash -> block map lives in the BlockPool (eviction happens there); this module
computes hashes and decides hits.
"""

from __future__ import annotations

import hashlib

from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.request import Request


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
    """

    def __init__(self, pool: BlockPool, block_size: int, enabled: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.requeried_tokens = 0
        self.rehit_tokens = 0
        # called with (block id, hash, key) when a block enters the cache (a KV tier's
        # write-through: engine/kv/tiers/link.py); None = nothing
        self.on_cached = None

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

    def find_longest_cache_hit(self, req: Request) -> list[int]:
        """Block ids of the longest verified cached prefix of ``req`` (no references taken).

        At most ``(req.num_tokens - 1) // block_size`` blocks. Does not touch the counters:
        call ``record`` when the hit is actually used.
        """
        if not self.enabled:
            return []
        hits = []
        for i in range((req.num_tokens - 1) // self.block_size):
            block_hash, key = self.block_hash(req, i)
            block = self.pool.lookup(block_hash)
            if block is None or block.hash_key != key:
                break
            hits.append(block.block_id)
        return hits

    def record(self, req: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup of ``req`` with ``num_hit_tokens`` reused: its prompt
        at the first admission, its whole length (apart) at a re-admission."""
        if not self.enabled:
            return
        if req.num_preemptions == 0:
            self.queried_tokens += req.num_prompt_tokens
            self.hit_tokens += min(num_hit_tokens, req.num_prompt_tokens)
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
            block_id = req.block_table[i]
            if self.pool.cache_block(block_id, block_hash, key) and self.on_cached is not None:
                self.on_cached(block_id, block_hash, key)
        return num_full
