"""FullRetention: every token keeps its K/V, token ``pos`` at physical index ``pos``.

The retention of every request without an evicting ``--kv-policy``. It holds no state: each
answer follows from the logical length, in O(1), with no tensor.
"""

from __future__ import annotations

import sys

from kvledger.engine.retention.interface import HeldContext, Retention
from kvledger.engine.retention.policies import RetentionPolicy
from kvledger.ledger.retention import RetentionSpec


class FullRetention(Retention):
    """Keep everything: the block table read in order is the context."""

    policy = RetentionPolicy(RetentionSpec())
    chunk_tokens = sys.maxsize

    def kv_slots(self, num_computed_tokens: int) -> int:
        return num_computed_tokens

    def reset(self, num_hit_tokens: int = 0) -> None:
        pass

    def append(self, start: int, n: int) -> None:
        pass

    def shareable_tokens(self, num_prompt_tokens: int) -> int:
        return sys.maxsize

    def hit_tokens(self, num_prompt_tokens: int) -> int:
        return sys.maxsize

    def retain(self, block_table, next_pos, num_prompt_tokens, pool, store) -> list[int]:
        return block_table

    def attention(self, block_table, start, n, num_prompt_tokens) -> HeldContext | None:
        return None

    def observer(self, context, rows) -> None:
        return None

    def held_per_block(self, num_computed_tokens: int, block_size: int) -> list[int]:
        return [min(block_size, num_computed_tokens - i)
                for i in range(0, num_computed_tokens, block_size)]
