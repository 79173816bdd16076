"""The admission rule: how many tokens one request may ever reach, from the KV it may hold.

One request of ``T`` tokens (prompt + output) stores K/V for ``T - 1`` of them: the last sampled
token is returned, never fed back. Under full retention (every token kept, the only policy
today) ``n`` KV tokens occupy ``ceil(n / block_size)`` paged blocks. A request may hold at most
``max_blocks`` blocks (the whole pool, or the long-request share of it), at most
``quota_tokens`` tokens (prompt + output, ``--max-kv-tokens-per-request``) and at most the
model's context. So the most tokens it may reach is

    min(context_tokens, max_blocks * block_size + 1, quota_tokens)

and a request asking for ``prompt + max_tokens`` tokens can ever run exactly when that sum is
within this limit. The engine's admission, its "up to the limit" max_tokens, its refusal
messages and its failure of a request that outgrows the pool all read it from here; a
retention policy bounds the KV by its own figure (``ledger/retention.py``: ``kv_blocks_of`` and
``exceeded_by`` take it), a KV format changes the bytes per block and so ``max_blocks`` (``costs.blocks_for(pool_bytes, block_bytes)``), and
nothing else has to follow. A model of several layer groups (full and sliding layers,
``kv_groups.py``) counts pages by ``kv_groups.peak_blocks`` instead of ``ceil(n / block_size)``:
its sliding groups hold a window's blocks at any length.

Pure integers, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvledger.ledger.kv_groups import KVGroup, peak_blocks
from kvledger.ledger.retention import RetentionSpec


def blocks_for_kv_tokens(num_kv_tokens: int, block_size: int) -> int:
    """Paged blocks that hold ``num_kv_tokens`` K/V slots under full retention:
    ``ceil(n / block_size)``. The KV manager allocates by it and admission checks by it."""
    return math.ceil(num_kv_tokens / block_size)


def kv_tokens_of(total_tokens: int) -> int:
    """KV slots a request of ``total_tokens`` (prompt + output) ever fills: one fewer, because
    the last sampled token is never fed back (0 for 0 tokens)."""
    return max(total_tokens - 1, 0)


@dataclass(frozen=True)
class RequestBudget:
    """What one request may hold.

    Attributes:
        block_size: tokens per KV block.
        max_blocks: most blocks the request may hold at once (pool size, or its share of it).
        context_tokens: the model's context limit in tokens.
        quota_tokens: per-request limit on prompt + output tokens (None = no quota).
        groups: the model's layer groups (``kv_groups.kv_groups``); blocks are then pages,
            counted by ``kv_groups.peak_blocks``. Empty: one table of full attention.
    """

    block_size: int
    max_blocks: int
    context_tokens: int
    quota_tokens: int | None = None
    groups: tuple[KVGroup, ...] = ()

    def blocks_for(self, num_kv_tokens: int) -> int:
        """Most blocks (pages) a request holds while it fills ``num_kv_tokens`` K/V slots
        under full retention."""
        if not self.groups:
            return blocks_for_kv_tokens(num_kv_tokens, self.block_size)
        return peak_blocks(self.groups, num_kv_tokens, self.block_size)

    def kv_blocks_of(self, total_tokens: int, retention: RetentionSpec | None = None,
                     num_prompt_tokens: int = 0) -> int:
        """Most blocks a request of ``total_tokens`` (prompt + output) ever holds: full
        retention's ``ceil((total - 1) / block_size)``, or the bounded figure of an evicting
        ``retention`` policy (``RetentionSpec.max_kv_blocks``)."""
        if retention is None or not retention.evicts:
            return self.blocks_for(kv_tokens_of(total_tokens))
        return retention.max_kv_blocks(num_prompt_tokens, total_tokens, self.block_size)

    def holds_kv_tokens(self, num_kv_tokens: int) -> bool:
        """True when ``num_kv_tokens`` K/V slots fit in ``max_blocks`` blocks."""
        return self.blocks_for(num_kv_tokens) <= self.max_blocks

    @property
    def max_kv_tokens(self) -> int:
        """Most K/V slots the request may fill: ``max_blocks * block_size`` (with layer
        groups: the most whose :meth:`blocks_for` fits, at most the context)."""
        if not self.groups:
            return self.max_blocks * self.block_size
        lo, hi = 0, self.context_tokens  # blocks_for grows with the tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.holds_kv_tokens(mid) else (lo, mid - 1)
        return lo

    @property
    def max_total_tokens(self) -> int:
        """Most tokens (prompt + output) the request may reach: context, pool share, quota."""
        limit = min(self.context_tokens, self.max_kv_tokens + 1)
        return limit if self.quota_tokens is None else min(limit, self.quota_tokens)

    def exceeded_by(self, total_tokens: int, retention: RetentionSpec | None = None,
                    num_prompt_tokens: int = 0) -> str | None:
        """Which limit ``total_tokens`` (prompt + output) passes first, checked in the order
        ``"context"``, ``"quota"``, ``"kv"``; None when it is within all of them.

        Under a policy with a capacity (window, sinks, h2o) positions may pass the context
        (kept keys keep their positions; RoPE is computed for any position), and the quota and
        the pool are checked against the bounded KV (``RetentionSpec.max_kv_tokens`` + the one
        token never fed back, ``kv_blocks_of``)."""
        bounded = retention is not None and retention.capacity is not None
        if total_tokens > self.context_tokens and not bounded:
            return "context"
        kv_total = total_tokens
        if retention is not None and retention.evicts:
            kv_total = retention.max_kv_tokens(num_prompt_tokens, total_tokens) + 1
        if self.quota_tokens is not None and kv_total > self.quota_tokens:
            return "quota"
        if self.kv_blocks_of(total_tokens, retention, num_prompt_tokens) > self.max_blocks:
            return "kv"
        return None
