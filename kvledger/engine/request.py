"""Request: everything the engine knows about one request, in one object.

The engine keeps one registry of live requests (``Scheduler.requests``, id -> Request); every
other part (KV manager, prefix cache, sampler, runner, detokenizer) gets the Request itself and
keeps no per-request table of its own, so finishing or aborting a request is dropping it from
that registry and from the scheduler's queues. A request is *unfinished* exactly while it is in
the registry (``status`` WAITING or RUNNING).

Tokens: the prompt, then the tokens generated so far; ``num_computed_tokens`` of them already
have their K/V in the paged cache. Tokens ``[0, num_computed_tokens)`` live in the blocks of
``block_table`` (token ``pos`` in block ``block_table[pos // block_size]`` at offset
``pos % block_size``), one table per layer group (``block_tables``, ``ledger/kv_groups.py``;
a sliding group's blocks before its window are ``NULL_BLOCK``); tokens ``[num_computed_tokens, num_tokens)`` still need a forward pass.
After a decode step the newly sampled token is appended without KV, so a running request always
has at least one uncomputed token until it finishes.

Invariants (checked by ``Scheduler.check_invariants``):
  0 <= num_computed_tokens <= num_tokens;
  len(block_table) * block_size >= num_kv_slots while RUNNING (what ``retention`` makes of
  num_computed_tokens: the same under full retention, fewer under an evicting policy);
  block_table == [] while WAITING or FINISHED (preemption by recompute frees every block).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

NULL_BLOCK = -1
"""A block-table entry a sliding layer group gave back (vLLM's null block); read as block 0,
masked by the window."""

import torch

from kvledger.engine.output.detokenizer import IncrementalDetokenizer
from kvledger.engine.output.request_output import RequestMetrics, RequestOutput
from kvledger.engine.retention.full import FullRetention
from kvledger.engine.retention.interface import Retention
from kvledger.engine.sample.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is: queued (also after preemption), holding blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One request inside the engine.

    Attributes:
        request_id: caller's id, unique among unfinished requests.
        prompt_token_ids: prompt tokens (len >= 1).
        params: sampling parameters.
        cache_salt: mixed into the first block's hash so that only requests with the same salt
            share prefix-cache blocks (None = shared with every unsalted request).
        detokenizer: turns output tokens into text deltas (None: token ids only, as in the
            scheduler tests).
        max_tokens_effective: most tokens this request may generate; prompt + this is the most
            tokens it can ever hold. -1 until ``Scheduler.add`` resolves it from
            ``params.max_tokens`` or, for None, from the admission rule (context, quota, pool).
        output_token_ids: generated tokens, in order.
        status: WAITING, RUNNING or FINISHED.
        num_computed_tokens: tokens whose K/V is in the cache (prefix-cache hits included).
        block_tables: per layer group (``ledger/kv_groups.py``), KV block ids: block i holds
            tokens ``[i*block_size, (i+1)*block_size)``; ``NULL_BLOCK`` where a sliding group
            gave the block back (before its window). ``block_table`` is the first group's.
        num_dropped_blocks: leading entries of the sliding groups' tables given back.
        state_slot: its slot of the state layers' state (``engine/kv/state_store.py``) while
            it holds blocks, on a model with state layers; else None.
        missed_hit_tokens: prompt tokens the full layer groups held in the prefix cache beyond
            the hit taken, for lack of a sliding group's blocks (set at each lookup).
        block_hashes: chained hashes of its full blocks, computed lazily by the prefix cache;
            they depend on tokens only, so they survive preemption.
        num_hashed_blocks: leading blocks of ``block_table`` already registered in the prefix
            cache (reset when the blocks are freed).
        num_cached_tokens: tokens taken from the prefix cache at the first admission (metrics;
            vLLM's name).
        tier_blocks: block hash -> name of the KV tier each block loaded for it came from
            (``engine/kv/tiers/link.py``); cached_tokens_by_tier: its ``num_cached_tokens`` by
            where they came from (``pool``, ``ram``, ``disk``; empty without KV tiers).
        tier_load_s, tier_load_predicted_s: seconds its tier loads took, and the ledger's
            prediction of them (0 when none or unknown).
        num_preemptions: times this request was preempted by recompute.
        num_skips: admission passes that skipped it for lack of free blocks (starvation guard).
        peak_num_blocks: most blocks it held at once (peak KV bytes = this * bytes per block).
        is_long: prompt >= ``config.long_prompt_tokens`` (set by the scheduler on ``add``).
        retention: which tokens keep their K/V and where (``engine/retention/interface.py``):
            full retention (token ``pos`` at physical index ``pos``) unless the engine gives
            it an evicting policy's (physical slots vs logical positions, ``state.py``).
        generator: its seeded sampling generator (None when ``params.seed`` is None).
        grammar: its llguidance matcher, advanced by every sampled token, when
            ``params.structured_outputs`` constrains the output (``engine/sample/structured/``).
        spec_hits, spec_misses: its proposed tokens accepted, and its verifies that rejected
            one (speculative decoding: the gate's acceptance estimate, ``engine/spec/gate.py``).
        output: the caller-facing progress, updated in place by the engine each step; its
            ``metrics`` are this request's timings and KV figures.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    max_tokens_effective: int = -1
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_dropped_blocks: int = 0
    state_slot: int | None = None
    missed_hit_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_hashed_blocks: int = 0
    num_cached_tokens: int = 0
    tier_blocks: dict = field(default_factory=dict)
    cached_tokens_by_tier: dict = field(default_factory=dict)
    tier_load_s: float = 0.0
    tier_load_predicted_s: float = 0.0
    num_preemptions: int = 0
    num_skips: int = 0
    peak_num_blocks: int = 0
    is_long: bool = False
    retention: Retention = field(default_factory=FullRetention)
    grammar: Any = None
    spec_hits: int = 0
    spec_misses: int = 0
    generator: torch.Generator | None = field(init=False)
    output: RequestOutput = field(init=False)

    def __post_init__(self) -> None:
        seed = self.params.seed
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)
        self.output = RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            logprobs=[] if self.params.logprobs is not None else None,
            prompt_logprobs=[None] if self.params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(arrival_time=time.perf_counter(),
                                   num_prompt_tokens=len(self.prompt_token_ids)))

    @property
    def block_table(self) -> list[int]:
        """The first layer group's block table (the only one of a model of one kind)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def num_blocks_held(self) -> int:
        """Blocks (pages) its tables hold, ``NULL_BLOCK`` entries excluded."""
        return sum(len(t) for t in self.block_tables) - sum(
            1 for t in self.block_tables for b in t[:self.num_dropped_blocks] if b < 0)

    @property
    def metrics(self) -> RequestMetrics:
        """Timings (perf_counter seconds) and KV figures, shared with ``output``."""
        return self.output.metrics

    @property
    def is_finished(self) -> bool:
        """True once it stopped (EOS, stop, length, abort, error) and holds no blocks."""
        return self.status is RequestStatus.FINISHED

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
        """Tokens still without K/V in the cache (1 for a decoding request)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_kv_slots(self) -> int:
        """Physical KV slots the block table covers in use (holes included): the computed
        tokens under full retention."""
        return self.retention.kv_slots(self.num_computed_tokens)

    @property
    def max_total_tokens(self) -> int:
        """Prompt + ``max_tokens_effective``: the most tokens this request can ever hold."""
        return len(self.prompt_token_ids) + self.max_tokens_effective

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]
