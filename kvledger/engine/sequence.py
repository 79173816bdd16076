"""Sequence: one request's tokens and its KV bookkeeping as the scheduler sees it.

A sequence holds the prompt, the tokens generated so far and how many of them already have
their K/V in the paged cache (``num_computed_tokens``). Tokens ``[0, num_computed_tokens)`` live
in the blocks of ``block_table`` (token ``pos`` in block ``block_table[pos // block_size]`` at
offset ``pos % block_size``); tokens ``[num_computed_tokens, num_tokens)`` still need a forward
pass. After a decode step the newly sampled token is appended without KV, so a running sequence
always has at least one uncomputed token until it finishes.

Invariants (checked by the scheduler tests):
  0 <= num_computed_tokens <= num_tokens;
  len(block_table) * block_size >= num_computed_tokens while RUNNING;
  block_table == [] while WAITING or FINISHED (preemption by recompute frees every block).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvledger.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued (also after preemption), holding blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    """One request inside the engine.

    Attributes:
        request_id: caller's id, unique among unfinished requests.
        prompt_token_ids: prompt tokens (len >= 1).
        params: sampling parameters.
        arrival_time: ``time.perf_counter()`` seconds at ``add_request``.
        max_tokens_effective: most tokens this sequence may generate; prompt + this is the most
            tokens it can ever hold. The engine sets it from ``params.max_tokens`` or the context
            limit; if left at -1 the scheduler resolves it the same way on ``add``.
        cache_salt: mixed into the first block's hash so that only requests with the same salt
            share prefix-cache blocks (None = shared with every unsalted request).
        output_token_ids: generated tokens, in order.
        num_computed_tokens: tokens whose K/V is in the cache (prefix-cache hits included).
        block_table: KV block ids, block i holds tokens ``[i*block_size, (i+1)*block_size)``.
        status: WAITING, RUNNING or FINISHED.
        num_cached_tokens: prefix-cache hit tokens at the first schedule (for metrics).
        num_preemptions: times this sequence was preempted by recompute.
        peak_num_blocks: most blocks it held at once (peak KV bytes = this * bytes per block).
        is_long: prompt >= ``config.long_prompt_tokens`` (set by the scheduler on ``add``).
        block_hashes: chained hashes of its full blocks, computed lazily by the prefix cache;
            they depend on tokens only, so they survive preemption.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    max_tokens_effective: int = -1
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    peak_num_blocks: int = 0
    is_long: bool = False
    block_hashes: list[bytes] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still without K/V in the cache (1 for a decoding sequence)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Prompt + ``max_tokens_effective``: the most tokens this sequence can ever hold."""
        return len(self.prompt_token_ids) + self.max_tokens_effective

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
