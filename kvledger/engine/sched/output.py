"""What one scheduler step decided: the chunks to compute, and the requests preempted or failed.

The scheduler (scheduler.py) builds a ``SchedulerOutput``; the runner turns its chunks into one
forward pass, and the engine turns its preempted/failed lists into outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.engine.request import Request
from kvledger.errors import KVLedgerError


@dataclass
class ScheduledChunk:
    """Tokens of one request computed in this step.

    The step computes K/V for ``request.all_token_ids[start : start + num_new_tokens]`` where
    ``start`` is ``request.num_computed_tokens`` at schedule time; the token at absolute
    position ``pos`` goes to slot ``block_table[pos // block_size] * block_size + pos %
    block_size``. ``samples`` (fixed at schedule time) is True when the chunk reaches the
    request's last token, so the step yields logits to sample its next token from.
    ``draft``: tokens proposed after the request's last one (speculative decoding,
    ``engine/spec/``), computed at the chunk's last ``len(draft)`` positions (counted in
    ``num_new_tokens``) and verified by their logits; empty for a plain chunk.
    """

    request: Request
    num_new_tokens: int
    start: int = field(init=False)
    samples: bool = field(init=False)
    draft: list[int] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.start = self.request.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """One step: chunks to run, requests preempted, and requests failed (already freed)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, KVLedgerError]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(c.num_new_tokens for c in self.chunks)
