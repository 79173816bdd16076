"""RetainedKV: one sequence's held tokens under an evicting policy (logical vs physical).

The *logical* length is the sequence's positions (``Request.num_computed_tokens``, what the
user sees); the *physical* slots are what the block table stores. Physical index j lives at
slot ``block_table[j // block_size] * block_size + j % block_size`` and holds the token at
position ``pos[j]``, or nothing (``pos[j] == -1``, a hole left by a dropped token). New tokens
are appended after the last physical index, at their logical positions.

After every step (``Scheduler.advance``): the policy picks the tokens kept for the next
queries (:meth:`evict`), then :meth:`reclaim` gives back every block none of whose tokens is
kept and, for token-level policies, compacts the kept tokens once a block's worth of holes has
gathered: kept K/V are copied to lower physical indices (keys keep their original rotation, so
a move changes nothing in attention). A block that another sequence holds or that is in the
prefix cache is never written: its kept tokens are copied to a fresh block instead.

Positions: the new tokens' queries are always at their logical positions. Under ``cache``
positions (``RetentionSpec.positions``; StreamingLLM's scheme, held tokens at ``0..n-1`` in
slot order and the query at ``n``) every query-key distance must be the one of that scheme. RoPE
attention depends only on the distance (q at a, k at b: ``<R(a) q, R(b) k> = <q, R(b - a) k>``),
so the scheme is the same as adding ``start - n`` (the tokens dropped so far) to every cache
position: held token i (rank r_i, original position pos_i) must sit at ``r_i + start - n``, i.e.
be rotated forward by ``delta_i = r_i + start - n - pos_i`` >= 0, the tokens dropped after it
(:meth:`key_shift`). Under window/sinks the window is contiguous, so its delta is 0 and only the
sinks turn: by the count of dropped tokens. The rotation is applied to the keys as attention
gathers them (``R(a + d) = R(d) R(a)``: one rotation by ``delta`` of the stored key, from the
key as computed, never accumulated), not written into the blocks: a block's bytes stay what
full retention computed, so sharing and hashing are unchanged, and nothing is rotated twice.

Until the first token is dropped or moved, ``identity`` holds (pos[j] == j): only then may the
sequence's blocks be hashed into the prefix cache (``KVCacheManager.cache_full_blocks``).
"""

from __future__ import annotations

import sys

import torch

from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.kv.store import KVStore
from kvledger.engine.retention.interface import HeldContext, Retention
from kvledger.engine.retention.observe import AttentionObserver
from kvledger.engine.retention.policies import RetentionPolicy
from kvledger.ledger.retention import EVICTION_CHUNK


class RetainedKV(Retention):
    """Held positions and accumulated attention of one sequence's physical slots (one
    selection for all layers and heads; per (layer, KV head): ``per_head.PerHeadKV``): the
    :class:`~kvledger.engine.retention.interface.Retention` of an evicting policy.

    Args:
        policy: the sequence's retention policy.
        block_size: tokens per block.

    Attributes:
        heads: (layers, kv_heads) when each (layer, KV head) selects its own tokens; None here.
    """

    heads: tuple[int, int] | None = None

    def __init__(self, policy: RetentionPolicy, block_size: int) -> None:
        self.policy, self.block_size = policy, block_size
        self.reset()

    def reset(self, num_hit_tokens: int = 0) -> None:
        """Start over holding positions ``[0, num_hit_tokens)`` (prefix-cache hit or none)."""
        self.pos = torch.arange(num_hit_tokens, dtype=torch.int64)
        self.scores = torch.zeros(num_hit_tokens)
        self.identity = True
        self.compressed = False
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_slots(self) -> int:
        """Physical slots used, holes included (the block table covers them)."""
        return len(self.pos)

    def kv_slots(self, num_computed_tokens: int) -> int:
        return self.num_slots

    @property
    def chunk_tokens(self) -> int:
        """``EVICTION_CHUNK`` when the policy evicts between steps (its bound counts one
        such chunk), else no cap."""
        return EVICTION_CHUNK if self.policy.chunked else sys.maxsize

    def shareable_tokens(self, num_prompt_tokens: int) -> int:
        """The policy's shareable tokens until the first token is dropped or moved, then 0."""
        return self.spec.shareable_tokens(num_prompt_tokens) if self.identity else 0

    def hit_tokens(self, num_prompt_tokens: int) -> int:
        """The shareable tokens, at most the policy's ``cache_hit_tokens``."""
        allowed = self.spec.cache_hit_tokens(num_prompt_tokens)
        shareable = self.shareable_tokens(num_prompt_tokens)
        return shareable if allowed is None else min(shareable, allowed)

    @property
    def num_held(self) -> int:
        """Tokens whose K/V are kept."""
        return int((self.pos >= 0).sum())

    def held_per_block(self, num_computed_tokens: int, block_size: int) -> list[int]:
        """Kept tokens in each block of the table (the last one may be partly filled), from
        the held positions."""
        bs = self.block_size
        pad = -len(self.pos) % bs
        padded = torch.cat([self.pos, torch.full((pad,), -1, dtype=torch.int64)])
        return (padded.view(-1, bs) >= 0).sum(1).tolist()

    def slots(self, block_table: list[int], idx: torch.Tensor) -> torch.Tensor:
        """Slots [k] of physical indices ``idx`` [k] through ``block_table``."""
        table = torch.tensor(block_table, dtype=torch.int64)
        return table[idx // self.block_size] * self.block_size + idx % self.block_size

    def context(self, block_table: list[int], start: int, n: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What ``n`` new tokens at positions ``[start, start + n)`` attend.

        Returns:
            (ctx_slots [c], ctx_idx [c] physical indices, mask [n, c] bool, new_slots [n]):
            the held tokens then the new ones; mask = causal and the policy's ``visible``.
        """
        q_pos = torch.arange(start, start + n)
        new_idx = torch.arange(self.num_slots, self.num_slots + n)
        held_idx = (self.pos >= 0).nonzero().flatten()
        ctx_idx = torch.cat([held_idx, new_idx])
        k_pos = torch.cat([self.pos[held_idx], q_pos])
        mask = (k_pos[None, :] <= q_pos[:, None]) & self.policy.visible(q_pos, k_pos)
        ctx_slots = self.slots(block_table, ctx_idx)
        return ctx_slots, ctx_idx, mask, ctx_slots[len(held_idx):]

    def attention(self, block_table: list[int], start: int, n: int,
                  num_prompt_tokens: int) -> HeldContext:
        """The held tokens and the new ones (:meth:`context`), the keys that turn
        (:meth:`key_shift`) and the queries the policy scores."""
        slots, idx, mask, new_slots = self.context(block_table, start, n)
        scored = self.policy.scored_queries(torch.arange(start, start + n), num_prompt_tokens)
        if scored is not None and not bool(scored.any()):
            scored = None
        return HeldContext(slots, idx, mask, new_slots, self.key_shift(start), scored)

    def observer(self, context: HeldContext, rows: slice) -> AttentionObserver | None:
        """An observer of ``context``'s scored queries, whose scores the next :meth:`append`
        adds (``pending``); None when no query is scored."""
        if context.scored is None:
            return None
        observer = AttentionObserver(rows, context.slots, context.mask, context.scored,
                                     self.heads)
        self.pending = (context.index, observer.scores)
        return observer

    def key_shift(self, start: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """How far held keys turn for queries from ``start`` on under ``cache`` positions.

        Returns:
            (rows [r], delta [r] int64 > 0): rows of the held tokens (in the order of
            :meth:`context`'s ``ctx_idx``) whose keys rotate forward by ``delta`` positions;
            None under original positions or when no held key turns.
        """
        if self.policy.spec.positions != "cache":
            return None
        held_pos = self.pos[self.pos >= 0]
        rank = torch.arange(len(held_pos))
        delta = rank + (start - len(held_pos)) - held_pos
        rows = delta.nonzero().flatten()
        return (rows, delta[rows]) if len(rows) else None

    def append(self, start: int, n: int) -> None:
        """Record ``n`` computed tokens at positions ``[start, start + n)`` and add the
        attention the step observed (``pending``) to the scores."""
        self.pos = torch.cat([self.pos, torch.arange(start, start + n)])
        self.scores = torch.cat([self.scores, torch.zeros(n)])
        if self.pending is not None:
            idx, observed = self.pending
            self.scores.index_add_(0, idx, observed)
            self.pending = None

    def retain(self, block_table: list[int], next_pos: int, num_prompt_tokens: int,
               pool: BlockPool, store) -> list[int]:
        """:meth:`evict`, then :meth:`reclaim`."""
        self.evict(next_pos, num_prompt_tokens)
        return self.reclaim(block_table, pool, store)

    def evict(self, next_pos: int, num_prompt_tokens: int) -> int:
        """Drop the held tokens the policy does not keep for queries from ``next_pos`` on.

        Returns:
            Tokens dropped.
        """
        held = (self.pos >= 0).nonzero().flatten()
        keep = self.policy.keep(self.pos[held], self.scores[held], next_pos,
                                num_prompt_tokens, self.compressed)
        if self.policy.compacts and next_pos >= num_prompt_tokens:
            self.compressed = True
        dropped = held[~keep]
        if len(dropped):
            self.pos[dropped] = -1
            self.scores[dropped] = 0
            self.identity = False
        return len(dropped)

    def reclaim(self, block_table: list[int], pool: BlockPool, store: KVStore | None
                ) -> list[int]:
        """Give back blocks with no kept token; compact token-level policies' holes.

        Returns:
            The new block table (blocks given back are freed in ``pool``).
        """
        bs = self.block_size
        pad = len(block_table) * bs - self.num_slots
        padded = torch.cat([self.pos, torch.full((pad,), -1, dtype=torch.int64)])
        alive = (padded.view(-1, bs) >= 0).any(1)
        if not bool(alive.all()):
            dead = (~alive).nonzero().flatten().tolist()
            pool.free(block_table[b] for b in reversed(dead))
            keep_idx = (alive.repeat_interleave(bs)[: self.num_slots]).nonzero().flatten()
            self.pos, self.scores = self.pos[keep_idx], self.scores[keep_idx]
            block_table = [b for b, a in zip(block_table, alive.tolist()) if a]
            self.identity = False
        holes = int((self.pos < 0).sum())
        if self.policy.compacts and holes >= bs and store is not None:
            block_table = self._compact(block_table, pool, store)
        return block_table

    def _compact(self, block_table: list[int], pool: BlockPool, store: KVStore) -> list[int]:
        """Move the kept tokens from the first block with a hole on to consecutive slots."""
        bs = self.block_size
        first = int((self.pos < 0).nonzero()[0]) // bs
        tail = torch.arange(first * bs, self.num_slots)
        kept = tail[self.pos[tail] >= 0]
        num_dst = -(-len(kept) // bs)
        dst_table = list(block_table[first: first + num_dst])
        frozen = [i for i, b in enumerate(dst_table)
                  if pool.blocks[b].ref_cnt > 1 or pool.blocks[b].block_hash is not None]
        if len(frozen) > pool.num_free:
            return block_table  # no block to copy into: compact at a later step
        for i, block in zip(frozen, pool.allocate(len(frozen))):
            dst_table[i] = block
        src = self.slots(block_table, kept)
        new_table = block_table[:first] + dst_table
        dst = self.slots(new_table, torch.arange(first * bs, first * bs + len(kept)))
        store.copy_slots(src, dst)
        released = [b for b in block_table[first:] if b not in set(dst_table)]
        pool.free(reversed(released))
        self.pos = torch.cat([self.pos[: first * bs], self.pos[kept]])
        self.scores = torch.cat([self.scores[: first * bs], self.scores[kept]])
        self.identity = False
        return new_table
