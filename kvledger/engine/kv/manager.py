"""KVCacheManager: which blocks each sequence holds (block tables over the BlockPool).

A running request's block table covers at least its computed tokens; ``allocate_slots`` grows it
so tokens ``[0, num_computed_tokens + num_new_tokens)`` have slots, all-or-nothing. At admission
a prefix-cache hit puts the hit blocks at the head of the table (a reference each, no copy: hit
blocks are full, so the request never writes into a shared block) and starts
``num_computed_tokens`` at the hit length. After the model ran, ``cache_full_blocks`` puts newly
full blocks in the prefix cache. ``free`` drops the references tail-first (see pool.py for why).
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

from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.kv.prefix import PrefixCache
from kvledger.engine.kv.store import KVStore
from kvledger.engine.request import Request
from kvledger.ledger.admission import blocks_for_kv_tokens


class KVCacheManager:
    """Block tables of requests over one BlockPool, with the prefix cache.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: False disables hashing and hits.
        store: where retention compaction copies K/V, through ``copy_slots(src, dst)``: the
            KV store, or under tensor parallelism the runner that has every rank copy (None: no
            compaction).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 store: KVStore | None = None):
        self.block_size = block_size
        self.store = store
        self.pool = BlockPool(num_blocks)
        self.prefix = PrefixCache(self.pool, block_size, enable_prefix_caching)
        self.tiers = None  # a TierLink (engine/kv/tiers/link.py) when KV tiers are on

    def _required_blocks(self, num_tokens: int) -> int:
        return blocks_for_kv_tokens(num_tokens, self.block_size)

    def find_longest_cache_hit(self, req: Request) -> list[int]:
        """Prefix-cache blocks ``req`` may start from (only for a request holding no blocks).

        Takes no references and counts nothing; pass the result to ``allocate_slots``.
        The hit covers ``len(result) * block_size`` tokens.
        """
        assert not req.block_table, "prefix lookup is for requests holding no blocks"
        if req.params.prompt_logprobs is not None:
            return []  # every prompt position's logits are wanted (engine/prompt_logprobs.py)
        hits = self.prefix.find_longest_cache_hit(req)
        limit = min((req.num_tokens - 1) // self.block_size,
                    req.retention.hit_tokens(req.num_prompt_tokens) // self.block_size)
        hits = hits[:limit]
        if self.tiers is not None and self.prefix.enabled and len(hits) < limit:
            hits = self.tiers.extend(req, hits, limit)  # continues into the KV tiers
        return hits

    def blocks_needed(
        self, req: Request, num_new_tokens: int, hit_blocks: list[int] | None = None
    ) -> tuple[int, int]:
        """(growth of ``req``'s block table, blocks taken off the free list) for this allocation.

        The two differ by the hit blocks that are already in use by another request (shared,
        they grow the table but take nothing from the free list).
        """
        hit_blocks = hit_blocks or []
        num_computed = req.num_kv_slots + len(hit_blocks) * self.block_size
        required = self._required_blocks(num_computed + num_new_tokens)
        growth = max(0, required - len(req.block_table))
        new = max(0, growth - len(hit_blocks))
        revived = sum(1 for b in hit_blocks if self.pool.is_free(b))
        return growth, new + revived

    def allocate_slots(
        self, req: Request, num_new_tokens: int, hit_blocks: list[int] | None = None
    ) -> bool:
        """Give ``req`` slots for its next ``num_new_tokens`` tokens; all or nothing.

        With ``hit_blocks`` (admission of a request holding no blocks): take a reference
        on each hit block, put them first in the table, set ``num_computed_tokens`` to the hit
        length and record the lookup in the prefix-cache counters.

        Returns:
            False, changing nothing, when the pool lacks free blocks.
        """
        _, from_free = self.blocks_needed(req, num_new_tokens, hit_blocks)
        if from_free > self.pool.num_free:
            return False
        if not req.block_table:
            hit_blocks = hit_blocks or []
            hit_tokens = len(hit_blocks) * self.block_size
            self.prefix.record(req, hit_tokens)
            self.pool.touch(hit_blocks)
            req.block_table = list(hit_blocks)
            req.num_computed_tokens = hit_tokens
            req.num_hashed_blocks = len(hit_blocks)
            req.retention.reset(hit_tokens)
        required = self._required_blocks(req.num_kv_slots + num_new_tokens)
        req.block_table += self.pool.allocate(max(0, required - len(req.block_table)))
        req.peak_num_blocks = max(req.peak_num_blocks, len(req.block_table))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Put the full blocks of ``req``'s computed tokens in the prefix cache (after compute)."""
        limit = req.retention.shareable_tokens(req.num_prompt_tokens) // self.block_size
        req.num_hashed_blocks = self.prefix.cache_full_blocks(req, req.num_hashed_blocks, limit)

    def retain(self, req: Request) -> None:
        """After a step of ``req``: give back (or compact) the blocks its retention frees
        (none under full retention)."""
        req.block_table = req.retention.retain(req.block_table, req.num_computed_tokens,
                                               req.num_prompt_tokens, self.pool, self.store)

    def free(self, req: Request) -> None:
        """Drop ``req``'s references tail-first and empty its block table."""
        self.pool.free(reversed(req.block_table))
        req.block_table = []
        req.num_hashed_blocks = 0
        req.retention.reset()
