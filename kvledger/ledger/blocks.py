"""Paged-KV block arithmetic and the one admission rule: can a request ever fit?

A paged engine (vLLM's PagedAttention, arXiv:2309.06180 §4) keeps K/V in fixed blocks of
``block_size`` token slots; a sequence holds ``ceil(kv_tokens / block_size)`` blocks. The KV
slots a request needs at most are ``prompt + max_tokens - 1``: the last sampled token is
returned and never fed back, so its K/V is never written.

A request can *ever* fit when, with the pool (or the share of it the request may hold) empty of
everyone else, its largest KV fits and it is within its per-request quota. Admission, quotas, the
server's error message and the planner all ask :class:`KVRoom`, so a retention policy or a KV
format changes the answer in one place. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.errors import InvalidParameterError, KVBudgetError


def blocks_for(pool_bytes: int, block_bytes: int) -> int:
    """Whole blocks of ``block_bytes`` a pool of ``pool_bytes`` holds (0 when the pool is empty
    or negative): vLLM's "# GPU blocks" = ``floor(pool / block bytes)``.

    Raises:
        InvalidParameterError: ``block_bytes <= 0``.
    """
    if block_bytes <= 0:
        raise InvalidParameterError(f"a KV block must have a positive size, got {block_bytes}")
    return max(pool_bytes, 0) // block_bytes


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` KV slots: ``ceil(tokens / block_size)`` (0 for 0 tokens)."""
    return -(-max(tokens, 0) // block_size)


def concurrency_ratio(pool_blocks: int, tokens: int, block_size: int) -> float:
    """How many ``tokens``-long requests the pool holds at once, as vLLM logs it ("Maximum
    concurrency for 20,000 tokens per request: 1.56x"): pool blocks / blocks per request."""
    return pool_blocks / blocks_for_tokens(tokens, block_size)


def request_kv_tokens(total_tokens: int) -> int:
    """KV slots a request of ``total_tokens`` = prompt + max_tokens needs at most:
    ``total_tokens - 1`` (the last sampled token is never fed back)."""
    return max(total_tokens - 1, 0)


@dataclass(frozen=True)
class KVRoom:
    """The most KV one request may ever hold.

    Attributes:
        block_size: tokens per block.
        blocks: blocks the request may hold with nobody else running: the pool's blocks, or
            the long-request share of them.
        quota_tokens: per-request quota on prompt + max_tokens (``--max-kv-tokens-per-request``);
            None = no quota.
        bytes_per_block: bytes of one block, for the message only (None = not shown).
        where: what ``blocks`` is, for the message ("the KV pool", "the long-request share of
            the KV pool").
    """

    block_size: int
    blocks: int
    quota_tokens: int | None = None
    bytes_per_block: int | None = None
    where: str = "the KV pool"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise InvalidParameterError(f"--block-size must be positive, got {self.block_size}")

    def holds(self, kv_tokens: int) -> bool:
        """True when ``kv_tokens`` KV slots fit in :attr:`blocks` (the quota aside)."""
        return blocks_for_tokens(kv_tokens, self.block_size) <= self.blocks

    def max_total_tokens(self, context: int) -> int:
        """Most prompt + output tokens a request may reach: the context, the pool
        (``blocks x block_size`` slots, + 1 for the last token, which needs none; 0 without a
        block, as every request stores at least its prompt) and the quota, whichever is least."""
        pool = self.blocks * self.block_size + 1 if self.blocks > 0 else 0
        room = min(context, pool)
        return room if self.quota_tokens is None else min(room, self.quota_tokens)

    def refusal(self, total_tokens: int, what: str = "the request") -> str | None:
        """Why a request of ``total_tokens`` = prompt + max_tokens can never fit (one line,
        beginning with ``what``), or None when it can. The quota is checked first."""
        if self.quota_tokens is not None and total_tokens > self.quota_tokens:
            return (
                f"{what} exceeds the per-request KV quota of {self.quota_tokens} tokens "
                "(--max-kv-tokens-per-request); lower max_tokens or shorten the prompt"
            )
        kv_tokens = request_kv_tokens(total_tokens)
        if self.holds(kv_tokens):
            return None
        need = blocks_for_tokens(kv_tokens, self.block_size)
        bpb = self.bytes_per_block
        need_bytes = "" if bpb is None else f" ({need * bpb} bytes)"
        cap_bytes = "" if bpb is None else f" ({self.blocks * bpb} bytes)"
        return (
            f"{what} needs up to {kv_tokens} KV tokens = {need} blocks{need_bytes} but "
            f"{self.where} holds {self.blocks} blocks{cap_bytes}; lower max_tokens or raise "
            "--kv-cache-gib / --num-blocks"
        )

    def check(self, total_tokens: int, what: str = "the request") -> None:
        """Raise :class:`KVBudgetError` with :meth:`refusal`'s message when the request can
        never fit; return None when it can."""
        reason = self.refusal(total_tokens, what)
        if reason is not None:
            raise KVBudgetError(reason)
