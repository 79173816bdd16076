"""KVCacheManager: which blocks each sequence holds (block tables over the BlockPool).

A running sequence's block table covers at least its computed tokens; ``allocate_slots`` grows it
so tokens ``[0, num_computed_tokens + num_new_tokens)`` have slots, all-or-nothing. At admission
a prefix-cache hit puts the hit blocks at the head of the table (a reference each, no copy: hit
blocks are full, so the sequence never writes into a shared block) and starts
``num_computed_tokens`` at the hit length. After the model ran, ``cache_full_blocks`` makes newly
full blocks hash-addressable. ``free`` drops the references tail-first (see pool.py for why).

Retention-policy seam: ``num_required_blocks`` says how many table entries a sequence needs for a
token count. Full retention needs ``ceil(n / block_size)``; a sliding-window or sinks+window
policy (a later issue) would override it and release blocks that fell out of the window.
"""

from __future__ import annotations

from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.kv.prefix import PrefixCache
from kvledger.engine.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Block tables of sequences over one BlockPool, with the prefix cache.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: False disables hashing and hits.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix = PrefixCache(self.pool, block_size, enable_prefix_caching)
        self._num_hashed: dict[str, int] = {}

    def num_required_blocks(self, num_tokens: int) -> int:
        """Block-table length needed to hold ``num_tokens`` tokens (full retention)."""
        return cdiv(num_tokens, self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks ``seq`` may start from (only for a sequence holding no blocks).

        Takes no references and counts nothing; pass the result to ``allocate_slots``.
        The hit covers ``len(result) * block_size`` tokens.
        """
        assert not seq.block_table, "prefix lookup is for sequences holding no blocks"
        return self.prefix.find_longest_hit(seq)

    def blocks_needed(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> tuple[int, int]:
        """(growth of ``seq``'s block table, blocks taken off the free list) for this allocation.

        The two differ by the hit blocks that are already in use by another sequence (shared,
        they grow the table but take nothing from the free list).
        """
        computed_blocks = computed_blocks or []
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        required = self.num_required_blocks(num_computed + num_new_tokens)
        growth = max(0, required - len(seq.block_table))
        new = max(0, growth - len(computed_blocks))
        revived = sum(1 for b in computed_blocks if self.pool.is_free(b))
        return growth, new + revived

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Give ``seq`` slots for its next ``num_new_tokens`` tokens; all or nothing.

        With ``computed_blocks`` (admission of a sequence holding no blocks): take a reference
        on each hit block, put them first in the table, set ``num_computed_tokens`` to the hit
        length and record the lookup in the prefix-cache counters.

        Returns:
            False, changing nothing, when the pool lacks free blocks.
        """
        _, from_free = self.blocks_needed(seq, num_new_tokens, computed_blocks)
        if from_free > self.pool.num_free:
            return False
        if not seq.block_table:
            computed_blocks = computed_blocks or []
            hit_tokens = len(computed_blocks) * self.block_size
            self.prefix.record(seq.num_tokens, hit_tokens)
            self.pool.touch(computed_blocks)
            seq.block_table = list(computed_blocks)
            seq.num_computed_tokens = hit_tokens
            self._num_hashed[seq.request_id] = len(computed_blocks)
        required = self.num_required_blocks(seq.num_computed_tokens + num_new_tokens)
        seq.block_table += self.pool.allocate(max(0, required - len(seq.block_table)))
        seq.peak_num_blocks = max(seq.peak_num_blocks, len(seq.block_table))
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Make the full blocks of ``seq``'s computed tokens hash-addressable (after compute)."""
        done = self._num_hashed.get(seq.request_id, 0)
        self._num_hashed[seq.request_id] = self.prefix.cache_full_blocks(seq, done)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references tail-first and empty its block table."""
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        self._num_hashed.pop(seq.request_id, None)
