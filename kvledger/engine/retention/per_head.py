"""PerHeadKV: per-(layer, KV head) token selection for h2o and snapkv (kvpress's shape).

Each (layer, KV head) — a *row*, ``row = layer * kv_heads + head`` — keeps its own tokens by
its own attention scores (``observe.py``: the query heads of its GQA group summed). Every row
keeps the same number of tokens (the policy's count is fixed by the budget: sinks, recent
window and observation window are positions every row holds), so the sequence still holds
whole blocks and the pool's bytes still equal the ledger's: ``pos[row, j]`` is the position
of the token that physical index j holds in that row's K/V.

The layout stays hole-free between steps: after an eviction each row's kept tokens are moved
into that row's holes below the new length (:meth:`PerHeadKV.reclaim`, one K/V head copy per
moved token, ``KVStore.copy_head_slots``), and the blocks past it go back to the pool. So
every row holds physical indices ``[0, num_slots)``, and what a query attends is the same list
of slots for every head: the held ones (all before the chunk; h2o/snapkv see every held key)
and the chunk's new ones, causally. Attention needs no per-head slot map: each backend's
decode and gathered prefill run unchanged, and a (head, token) pair not kept is never in any
head's context, because its slot now holds another token of that head or left the table.
Keys are stored rotated, so a moved key keeps its own original position.

A block that another sequence holds or the prefix cache keeps is never written: before a
head copy lands in one, the whole block is copied to a fresh block first (copy-on-write).
With no free block for that, the step's eviction is undone (the tokens stay one more step; the
next step's eviction chooses again).
"""

from __future__ import annotations

import logging

import torch

from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.retention.policies import RetentionPolicy
from kvledger.engine.retention.state import RetainedKV

log = logging.getLogger("kvledger.engine")


class PerHeadKV(RetainedKV):
    """Held positions and scores per (layer, KV head) row of one sequence's slots.

    Args:
        policy: the sequence's retention policy (h2o or snapkv).
        block_size: tokens per block.
        layers, kv_heads: the model's layers and KV heads (rows = layers * kv_heads; a replay
            without a model uses 1 x 1: the block accounting depends on counts only).

    Attributes:
        pos: [rows, num_slots] int64 position held by each row at each physical index (-1
            between an eviction and the reclaim that fills the hole).
        scores: [rows, num_slots] fp32 accumulated attention.
    """

    def __init__(self, policy: RetentionPolicy, block_size: int, layers: int,
                 kv_heads: int) -> None:
        self.heads = (layers, kv_heads)
        super().__init__(policy, block_size)

    @property
    def rows(self) -> int:
        """(layer, KV head) rows."""
        return self.heads[0] * self.heads[1]

    def reset(self, num_hit_tokens: int = 0) -> None:
        """Start over holding positions ``[0, num_hit_tokens)`` in every row."""
        super().reset(num_hit_tokens)
        self.pos = self.pos.repeat(self.rows, 1)
        self.scores = self.scores.repeat(self.rows, 1)
        self._undo: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_slots(self) -> int:
        return self.pos.shape[1]

    @property
    def num_held(self) -> int:
        """Tokens kept by each row (the same in every row)."""
        return int((self.pos[0] >= 0).sum())

    def held_per_block(self, num_computed_tokens: int, block_size: int) -> list[int]:
        bs = self.block_size
        return [min(bs, self.num_held - i) for i in range(0, self.num_held, bs)]

    def context(self, block_table, start, n):
        """What ``n`` new tokens at positions ``[start, start + n)`` attend: every held slot
        (each row's tokens there all precede the chunk) and the new ones causally; the same
        slots and mask for every head. Returns what :meth:`RetainedKV.context` returns."""
        held = self.num_slots
        ctx_idx = torch.arange(held + n)
        q_pos = torch.arange(start, start + n)
        k_pos = torch.cat([self.pos[0], q_pos])
        causal = torch.cat([torch.ones(n, held, dtype=torch.bool),
                            q_pos[None, :] <= q_pos[:, None]], 1)
        mask = causal & self.policy.visible(q_pos, k_pos)
        ctx_slots = self.slots(block_table, ctx_idx)
        return ctx_slots, ctx_idx, mask, ctx_slots[held:]

    def append(self, start: int, n: int) -> None:
        """Record ``n`` computed tokens in every row; add the step's per-head scores."""
        new = torch.arange(start, start + n).expand(self.rows, n)
        self.pos = torch.cat([self.pos, new], 1)
        self.scores = torch.cat([self.scores, torch.zeros(self.rows, n)], 1)
        if self.pending is not None:
            idx, observed = self.pending  # [c], [rows, c]
            self.scores.index_add_(1, idx, observed)
            self.pending = None

    def evict(self, next_pos: int, num_prompt_tokens: int) -> int:
        """Each row drops what the policy does not keep for it. Returns tokens dropped per row.

        Raises:
            RuntimeError: the rows would keep different numbers of tokens (a policy bug).
        """
        keep = self.policy.keep(self.pos, self.scores, next_pos, num_prompt_tokens,
                                self.compressed)
        if self.policy.compacts and next_pos >= num_prompt_tokens:
            self.compressed = True
        counts = keep.sum(-1)
        if not bool((counts == counts[0]).all()):
            raise RuntimeError(f"per-head selection kept unequal counts {counts.tolist()}")
        dropped = self.num_slots - int(counts[0])
        if dropped:
            self._undo = (self.pos.clone(), self.scores.clone())
            self.pos[~keep] = -1
            self.scores[~keep] = 0
            self.identity = False
        return dropped

    def reclaim(self, block_table: list[int], pool: BlockPool, store) -> list[int]:
        """Fill each row's holes below the kept count with its kept tokens above it (K/V head
        copies through ``store.copy_head_slots``; None: bookkeeping only), then give back the
        blocks past the kept count.

        Returns:
            The new block table.
        """
        kept, undo, self._undo = self.num_held, self._undo, None
        if kept == self.num_slots:
            return block_table
        bs = self.block_size
        r_dst, c_dst = (self.pos[:, :kept] < 0).nonzero(as_tuple=True)
        r_src, c_src = (self.pos[:, kept:] >= 0).nonzero(as_tuple=True)
        c_src = c_src + kept  # row-major: the i-th hole of a row gets its i-th mover
        if store is not None and len(c_dst):
            table = self._copy_on_write(block_table, sorted(set((c_dst // bs).tolist())),
                                        pool, store)
            if table is None:  # no block to copy a shared one into: keep the tokens a step
                self.pos, self.scores = undo
                return block_table
            block_table = table
            store.copy_head_slots(r_dst, self.slots(block_table, c_src),
                                  self.slots(block_table, c_dst))
        self.pos[r_dst, c_dst] = self.pos[r_src, c_src]
        self.scores[r_dst, c_dst] = self.scores[r_src, c_src]
        self.pos, self.scores = self.pos[:, :kept].contiguous(), self.scores[:, :kept].contiguous()
        need = -(-kept // bs)
        pool.free(reversed(block_table[need:]))
        return block_table[:need]

    def _copy_on_write(self, block_table: list[int], written: list[int], pool: BlockPool,
                       store) -> list[int] | None:
        """``block_table`` with each block of table indices ``written`` that another sequence
        holds or the prefix cache keeps replaced by a fresh copy (all layers and heads); None
        when the pool lacks the fresh blocks (nothing changed)."""
        frozen = [i for i in written if pool.blocks[block_table[i]].ref_cnt > 1
                  or pool.blocks[block_table[i]].block_hash is not None]
        if not frozen:
            return block_table
        if len(frozen) > pool.num_free:
            log.info("per-head retention: no free block to copy a shared block into; "
                     "eviction deferred a step")
            return None
        table = list(block_table)
        offsets = torch.arange(self.block_size)
        for i, fresh in zip(frozen, pool.allocate(len(frozen))):
            store.copy_slots(table[i] * self.block_size + offsets, fresh * self.block_size + offsets)
            pool.free([table[i]])
            table[i] = fresh
        return table
