"""BlockPool: metadata of the paged KV cache's blocks (ids, refcounts, hashes) and the free list.

The KV tensors live in the KV store (``engine/kv/store.py``), indexed by block id; a block here
carries nothing but ids. That is the codec seam: per-block scales of a quantized KV format live
in the store next to the block's K/V, indexed by the same block id, so nothing in this module
changes when a format adds them.

Accounting invariant (seed §4.3, SGLang's ``free + evictable + in use == total``): every block is
in exactly one of two states,

* in use: ``ref_cnt > 0``, held by one or more requests' block tables, not in the free list;
* free: ``ref_cnt == 0``, in the free list. A free block that still carries a block hash is
  *evictable*: it is still in the prefix cache, so a later request with the same prefix can take
  it back (``touch``) without recomputing it, until allocation pops it and evicts its hash.

So ``num_free + num_in_use == num_blocks`` and ``num_evictable <= num_free``
(``num_free - num_evictable`` free-and-empty + ``num_evictable`` + ``num_in_use`` = total).

Free-list order (vLLM v1's policy): allocation pops from the front. A block whose refcount drops
to 0 goes to the tail if it is hashed, to the front if not, so empty blocks are reused before
evictable ones and evictable blocks are evicted least-recently-freed first. Sequences free their
blocks tail-first, so a request's deepest prefix block is evicted before its parents. The free
list is an ``OrderedDict`` (O(1) pop-front, append, move-to-front and removal from the middle).

Block hashes are opaque keys (``bytes``, or ``(group, bytes)`` for a later layer group) computed by ``engine/kv/prefix.py``; the pool keeps the
hash -> block map (every cached block, in use or evictable) because eviction happens here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvledger.engine.kv.events.recorder import CacheEvents


@dataclass(slots=True)
class Block:
    """One KV block's metadata.

    Attributes:
        block_id: index of the block in the KV store's tensors.
        ref_cnt: number of block tables holding it.
        block_hash: chained prefix hash once the block is full and computed, else None.
        hash_key: what the hash was computed from (parent hash, token ids, extra keys), kept to
            verify a hit against the querying request's tokens.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    hash_key: tuple | None = None


class BlockPool:
    """Refcounted blocks with an O(1) free list and the hash -> block map of the prefix cache.

    Args:
        num_blocks: blocks in the pool (>= 1).
        on_release: called with a block id when it no longer holds anything to keep: its
            refcount drops to 0 and it is not in the prefix cache, or a free block's hash is
            evicted (the KV store drops a quantized format's residual buffer there, so a
            cached block keeps its buffer); None = nothing.
        events: told each block hash that enters the prefix cache (``stored(hash, key)``) and
            leaves it (``removed(hash)``): the KV events (``engine/kv/events/``); None =
            nothing.

    Misuse (freeing a free block, allocating more than is free) raises ``AssertionError``:
    those are bugs in the caller, not user errors.
    """

    def __init__(self, num_blocks: int, on_release: Callable[[int], None] | None = None,
                 events: CacheEvents | None = None) -> None:
        assert num_blocks >= 1, f"num_blocks must be >= 1, got {num_blocks}"
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[bytes, int] = {}
        self._num_evictable = 0
        self._ever_allocated = bytearray(num_blocks)
        self._num_touched = 0
        self.on_release = on_release
        self.events = events

    @property
    def num_free(self) -> int:
        """Blocks with refcount 0 (evictable ones included): what ``allocate`` can hand out."""
        return len(self._free)

    @property
    def num_touched(self) -> int:
        """Distinct blocks allocated at least once: the KV store maps its pages lazily
        (``store.lazy_zeros``), so about the share of the pool's bytes resident in RAM."""
        return self._num_touched

    @property
    def num_evictable(self) -> int:
        """Free blocks still in the prefix cache (reusable by a hit until evicted)."""
        return self._num_evictable

    @property
    def num_in_use(self) -> int:
        """Blocks with refcount > 0."""
        return self.num_blocks - len(self._free)

    def is_free(self, block_id: int) -> bool:
        """True when the block has refcount 0 (it sits in the free list)."""
        return block_id in self._free

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front of the free list, evicting their hashes; refcount 1.

        Raises:
            AssertionError: ``n > num_free``.
        """
        assert 0 <= n <= len(self._free), f"allocate({n}) with {len(self._free)} free blocks"
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            if not self._ever_allocated[block_id]:
                self._ever_allocated[block_id] = 1
                self._num_touched += 1
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on evictable or shared blocks (a prefix-cache hit)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
                if block.block_hash is not None:
                    self._num_evictable -= 1
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block, in the order given (pass a block table reversed).

        A block reaching refcount 0 goes to the tail of the free list if hashed (kept for reuse),
        to the front if not (reused first).

        Raises:
            AssertionError: a block is already free (double free).
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt > 0:
                continue
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)
                if self.on_release is not None:
                    self.on_release(block_id)
            else:
                self._num_evictable += 1

    def cache_block(self, block_id: int, block_hash: bytes, hash_key: tuple) -> bool:
        """Put an in-use, full, computed block in the prefix cache under ``block_hash``.

        Returns:
            False (and leaves the block unhashed) when another block already holds this hash,
            e.g. two requests with the same prompt prefilled in the same step.
        """
        block = self.blocks[block_id]
        assert block.ref_cnt > 0, f"caching free block {block_id}"
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._by_hash:
            return False
        block.block_hash = block_hash
        block.hash_key = hash_key
        self._by_hash[block_hash] = block_id
        if self.events is not None:
            self.events.stored(block_hash, hash_key)
        return True

    def lookup(self, block_hash: bytes) -> Block | None:
        """The block holding ``block_hash`` (in use or evictable), or None."""
        block_id = self._by_hash.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def evict_free_cached(self) -> int:
        """Drop every evictable block from the prefix cache (vLLM's ``reset_prefix_cache``);
        blocks in use keep their entries and refcounts. Returns the blocks dropped."""
        evictable = [i for i in self._free if self.blocks[i].block_hash is not None]
        for block_id in evictable:
            self.evict(block_id)
        return len(evictable)

    def evict(self, block_id: int) -> None:
        """Drop free block ``block_id``'s prefix-cache entry; it is reused first.

        Raises:
            AssertionError: the block is in use or not cached.
        """
        block = self.blocks[block_id]
        assert block.ref_cnt == 0 and block.block_hash is not None, f"evict({block_id})"
        self._evict(block)
        self._free.move_to_end(block_id, last=False)  # empty now: reused first

    def _evict(self, block: Block) -> None:
        """Drop a free block's hash (and, through ``on_release``, what it kept)."""
        del self._by_hash[block.block_hash]
        if self.events is not None:
            self.events.removed(block.block_hash)
        block.block_hash = None
        block.hash_key = None
        self._num_evictable -= 1
        if self.on_release is not None:
            self.on_release(block.block_id)

    def check_invariants(self) -> None:
        """Assert the accounting invariant (tests and debug mode; O(num_blocks))."""
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        assert len(in_use) + len(self._free) == self.num_blocks
        assert all(self.blocks[i].ref_cnt == 0 for i in self._free)
        evictable = sum(1 for i in self._free if self.blocks[i].block_hash is not None)
        assert evictable == self._num_evictable
        assert all(self.blocks[i].block_hash == h for h, i in self._by_hash.items())
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert hashed == len(self._by_hash)
