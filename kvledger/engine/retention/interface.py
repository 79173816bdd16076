"""Retention: the one interface the engine core asks about a request's held tokens.

Every ``Request`` has one (``Request.retention``): :class:`~kvledger.engine.retention.full.
FullRetention` keeps every token, ``state.RetainedKV`` / ``per_head.PerHeadKV`` hold what an
evicting policy keeps. The scheduler, the KV manager and the runner ask it, never which
policy it is:

- how many physical slots the block table covers (:meth:`Retention.kv_slots`: the logical
  length ``num_computed_tokens`` under full retention, fewer once tokens are dropped);
- how many tokens one step may compute (:attr:`Retention.chunk_tokens`);
- how far its blocks may be hashed into and hit in the prefix cache
  (:meth:`Retention.shareable_tokens`, :meth:`Retention.hit_tokens`);
- which blocks go back to the pool after a step (:meth:`Retention.retain`);
- which positions a chunk's queries see and which slots its tokens write
  (:meth:`Retention.attention`: None for the block table read in order, causally).

Full retention answers each in O(1) without touching a tensor, so its step costs what it cost
before the interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.retention.observe import AttentionObserver
from kvledger.engine.retention.policies import RetentionPolicy
from kvledger.ledger.retention import RetentionSpec


@dataclass
class HeldContext:
    """What ``n`` new tokens of a sequence attend when that is not its whole prefix.

    Attributes:
        slots: [c] slots of the context: the held tokens, then the n new ones.
        index: [c] their physical indices (where the observed scores are added).
        mask: [n, c] bool, causality and the policy's per-query visibility.
        new_slots: [n] the slots the new tokens write.
        key_turn: (rows [r], delta [r] int64 > 0): context rows whose keys rotate forward by
            ``delta`` positions (``cache`` positions); None when no key turns.
        scored: [n] bool, the queries whose attention is accumulated into the scores; None
            when none is.
    """

    slots: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor
    new_slots: torch.Tensor
    key_turn: tuple[torch.Tensor, torch.Tensor] | None
    scored: torch.Tensor | None

    def reads_in_place(self) -> bool:
        """True for one query that sees every held key unturned and is not scored: the slot
        list may be read where it lies (a decode over the pool viewed as one-token blocks)."""
        return (len(self.new_slots) == 1 and self.key_turn is None and self.scored is None
                and bool(self.mask.all()))


class Retention(ABC):
    """One request's retention: which of its tokens keep their K/V, and where.

    Attributes:
        policy: the policy's stateless decisions (``policies.py``; full: the base class).
        chunk_tokens: most tokens computed in one step (``EVICTION_CHUNK`` under a policy
            that evicts between steps; ``sys.maxsize``: no cap).
    """

    policy: RetentionPolicy
    chunk_tokens: int

    @property
    def spec(self) -> RetentionSpec:
        """The policy and its sizes."""
        return self.policy.spec

    @abstractmethod
    def kv_slots(self, num_computed_tokens: int) -> int:
        """Physical slots in use (holes included) of a sequence with ``num_computed_tokens``
        computed: what its block table must cover."""

    @abstractmethod
    def reset(self, num_hit_tokens: int = 0) -> None:
        """Start over holding positions ``[0, num_hit_tokens)`` (admission, preemption)."""

    @abstractmethod
    def append(self, start: int, n: int) -> None:
        """Record ``n`` tokens computed at positions ``[start, start + n)`` (after a step)."""

    @abstractmethod
    def shareable_tokens(self, num_prompt_tokens: int) -> int:
        """Leading tokens whose K/V are full retention's, so their blocks may be hashed into
        the prefix cache (``sys.maxsize``: all; 0 once a token was dropped or moved)."""

    @abstractmethod
    def hit_tokens(self, num_prompt_tokens: int) -> int:
        """Leading tokens a prefix-cache hit may cover at admission (``sys.maxsize``: all)."""

    @abstractmethod
    def retain(self, block_table: list[int], next_pos: int, num_prompt_tokens: int,
               pool: BlockPool, store) -> list[int]:
        """After a step: drop what the policy does not keep for queries from ``next_pos`` on,
        free in ``pool`` the blocks left with no kept token (compaction copies through
        ``store.copy_slots``; None: bookkeeping only). Returns the new block table."""

    @abstractmethod
    def attention(self, block_table: list[int], start: int, n: int,
                  num_prompt_tokens: int) -> HeldContext | None:
        """What ``n`` new tokens at positions ``[start, start + n)`` attend and write; None
        when it is positions ``[0, start + n)`` through ``block_table`` in order, causally."""

    @abstractmethod
    def observer(self, context: HeldContext, rows: slice) -> AttentionObserver | None:
        """The observer that scores ``context``'s queries (at ``rows`` of the step's flat
        batch) during the forward pass, its scores added at the next :meth:`append`; None
        when no query is scored."""

    @abstractmethod
    def held_per_block(self, num_computed_tokens: int, block_size: int) -> list[int]:
        """Kept tokens in each block of the table (the last one may be partly filled)."""
