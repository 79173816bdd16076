"""Scheduler: continuous batching over the paged KV cache (seed §4.3, §3.4, §5.3).

Each ``schedule()`` builds one step of at most ``max_num_batched_tokens`` tokens and
``max_num_seqs`` sequences, and allocates every slot the step writes before returning:

1. Running sequences, oldest first: decodes (1 token each) before continuing chunked prefills
   (``min(remaining, budget left)`` tokens, shrunk to the free blocks), so streams keep flowing
   while a long prompt is prefilled.
2. If nothing was preempted this step, waiting sequences FCFS: prefix-cache lookup, then the first
   chunk ``min(remaining, budget left)``. A sequence whose first uncached block is the very block
   a running sequence is computing now (same hash: e.g. a burst of requests with one system
   prompt) waits a step and then hits it instead of computing it twice. A sequence whose chunk does not fit the free blocks now
   is skipped so a later smaller one can start (no head-of-line blocking). Starvation guard: once
   a waiting sequence has been passed over for lack of blocks in ``HEAD_SKIP_LIMIT`` steps,
   nothing behind it is admitted until it is; running requests finish and free blocks, so it
   gets in. (Being held back by the long-request share does not count: admitting short requests
   behind a capped long one does not delay it.)

Preemption by recompute: when a running sequence cannot get a block for its next token, the
newest running sequence not yet scheduled in this step (possibly itself) loses all its blocks,
restarts at ``num_computed_tokens = 0`` and goes to the FRONT of the waiting queue, keeping its
output tokens; on resume prompt + output is prefilled again and its full blocks are usually
re-hit in the prefix cache (they were freed tail-first, so they are evicted last).

No deadlock, no livelock: ``add`` refuses at once (KVBudgetError) a request whose largest
possible KV (prompt + max_tokens - 1 tokens: the last sampled token is never cached) exceeds the
pool, its long-request share, or the per-request quota, so any admitted request fits when alone
and a step with running requests always schedules at least one chunk. Preemption only removes
requests admitted after the one that needs the block, so the oldest running request is never
preempted and keeps progressing. A sequence that outgrows what it may ever hold (only possible
when the engine runs it past ``max_tokens_effective``) is failed (``SchedulerOutput.failed``)
instead of being preempted and retried forever.

Long/short isolation (seed §3.4): requests whose prompt has >= ``long_prompt_tokens`` tokens may
hold together at most ``floor(long_kv_share * num_blocks)`` block-table entries (a shared prefix
block counts once per holder, so the cap is conservative).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvledger.engine.config import EngineConfig
from kvledger.engine.kv.manager import KVCacheManager, cdiv
from kvledger.engine.sequence import Sequence, SequenceStatus
from kvledger.errors import KVBudgetError, KVLedgerError

HEAD_SKIP_LIMIT = 32
"""Steps a waiting sequence may be passed over for lack of blocks before admission stops
behind it."""


@dataclass
class ScheduledChunk:
    """Tokens of one sequence computed in this step.

    The step computes K/V for ``seq.all_token_ids[start : start + num_new_tokens]`` where
    ``start`` is ``seq.num_computed_tokens`` at schedule time; the token at absolute position
    ``pos`` goes to slot ``block_table[pos // block_size] * block_size + pos % block_size``.
    ``samples`` (fixed at schedule time) is True when the chunk reaches the sequence's last
    token, so the step yields logits to sample its next token from.
    """

    seq: Sequence
    num_new_tokens: int
    start: int = field(init=False)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step: chunks to run, sequences preempted, and sequences failed (already freed)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, KVLedgerError]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    """Continuous-batching scheduler over a KVCacheManager.

    Args:
        config: engine options (budgets, prefix caching, long/short isolation, quota).
        num_blocks: KV pool size in blocks (sized by the ledger).
        block_size: tokens per block.
        bytes_per_block: KV bytes of one block over all layers (the ledger's figure; for
            messages and stats).
        max_model_len: context limit, used when ``max_tokens`` is None.
    """

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        block_size: int,
        bytes_per_block: int,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self._skips: dict[str, int] = {}
        long_on = config.long_prompt_tokens is not None
        self.long_cap_blocks = int(config.long_kv_share * num_blocks) if long_on else num_blocks

    # ------------------------------------------------------------------ requests in and out

    def add(self, seq: Sequence) -> None:
        """Queue a request (FCFS).

        Raises:
            KVBudgetError: it can never fit: prompt + max_tokens exceeds
                ``max_kv_tokens_per_request``, or its largest KV exceeds the pool (or the
                long-request share of it).
        """
        if seq.max_tokens_effective < 0:
            max_tokens = seq.params.max_tokens
            context_left = self.max_model_len - seq.num_prompt_tokens
            seq.max_tokens_effective = context_left if max_tokens is None else max_tokens
        long_tokens = self.config.long_prompt_tokens
        seq.is_long = long_tokens is not None and seq.num_prompt_tokens >= long_tokens
        self._check_fits(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def _check_fits(self, seq: Sequence) -> None:
        total = seq.max_total_tokens
        what = (
            f"request {seq.request_id!r} (prompt {seq.num_prompt_tokens} + max_tokens "
            f"{seq.max_tokens_effective} = {total} tokens)"
        )
        quota = self.config.max_kv_tokens_per_request
        if quota is not None and total > quota:
            raise KVBudgetError(
                f"{what} exceeds the per-request KV quota of {quota} tokens "
                "(--max-kv-tokens-per-request); lower max_tokens or shorten the prompt"
            )
        kv_tokens = total - 1
        blocks = cdiv(kv_tokens, self.block_size)
        cap = self.long_cap_blocks if seq.is_long else self.kv.pool.num_blocks
        if blocks > cap:
            where = "the long-request share of the KV pool" if seq.is_long else "the KV pool"
            bpb = self.bytes_per_block
            raise KVBudgetError(
                f"{what} needs up to {kv_tokens} KV tokens = {blocks} blocks "
                f"({blocks * bpb} bytes) but {where} holds {cap} blocks ({cap * bpb} bytes); "
                "lower max_tokens or raise --kv-cache-gib / --num-blocks"
            )

    def finish(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks tail-first and mark it FINISHED (EOS, stop, length, error)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        self.requests.pop(seq.request_id, None)
        self._skips.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish the request in whatever state it is (also mid chunked prefill); None if unknown."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self.finish(seq)
        return seq

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks and allocate their slots (see the module docstring)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prefills = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            n = self._grow(seq, min(seq.num_uncomputed_tokens, budget), scheduled, out)
            if n:
                out.chunks.append(ScheduledChunk(seq, n))
                scheduled.add(seq.request_id)
                budget -= n
        if not out.preempted:
            self._admit(budget, out)
        return out

    def _grow(self, seq: Sequence, n: int, scheduled: set[str], out: SchedulerOutput) -> int:
        """Tokens of ``seq``'s next chunk that get slots (<= n), preempting newer sequences as
        needed; 0 when ``seq`` itself was preempted or failed."""
        if self._outgrows_cap(seq, seq.num_computed_tokens + 1):
            self._fail(seq, out)
            return 0
        while True:
            fit = self._tokens_that_fit(seq, n)
            if fit == n or (fit > 0 and n > 1):
                ok = self.kv.allocate_slots(seq, fit)
                assert ok, "scheduler bug: tokens fit but allocation failed"
                return fit
            victim = self._victim(seq, scheduled)
            # Alone, a sequence within its cap always fits: the rest of the pool is free.
            assert victim is not seq or len(self.running) > 1, "scheduler bug: lone sequence"
            self._preempt(victim, out)
            if victim is seq:
                return 0

    def _outgrows_cap(self, seq: Sequence, num_tokens: int) -> bool:
        """True when ``num_tokens`` of ``seq`` exceed what it may ever hold (pool or long share);
        only possible when the engine runs it past ``max_tokens_effective``."""
        cap = self.long_cap_blocks if seq.is_long else self.kv.pool.num_blocks
        return self.kv.num_required_blocks(num_tokens) > cap

    def _tokens_that_fit(self, seq: Sequence, n: int) -> int:
        """Most of the next ``n`` tokens of a running ``seq`` that the free blocks can hold."""
        free_blocks = self.kv.pool.num_free
        if seq.is_long:
            free_blocks = min(free_blocks, self.long_cap_blocks - self._long_blocks_held())
        slack = len(seq.block_table) * self.block_size - seq.num_computed_tokens
        return max(0, min(n, slack + free_blocks * self.block_size))

    def _victim(self, seq: Sequence, scheduled: set[str]) -> Sequence:
        """Newest running sequence not scheduled in this step (long ones only if ``seq`` is
        long and the long share, not the pool, is what ran out)."""
        long_only = seq.is_long and self.kv.pool.num_free > 0
        for cand in reversed(self.running):
            if cand.request_id not in scheduled and (cand.is_long or not long_only):
                return cand
        return seq

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _fail(self, seq: Sequence, out: SchedulerOutput) -> None:
        error = KVBudgetError(
            f"request {seq.request_id!r} cannot grow past {seq.num_computed_tokens} tokens: "
            f"the KV pool ({self.kv.pool.num_blocks} blocks of {self.block_size} tokens"
            f"{', long-request share ' + str(self.long_cap_blocks) if seq.is_long else ''}) "
            "is too small; lower max_tokens or raise --kv-cache-gib / --num-blocks"
        )
        self.finish(seq)
        out.failed.append((seq, error))

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        """Admit waiting sequences FCFS without head-of-line blocking (module docstring)."""
        if not self.waiting:
            return
        prefilling = [s for s in self.running if s.num_uncomputed_tokens > 1]
        in_flight = {self._next_block_hash(s) for s in prefilling} - {None}
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self.kv.pool.num_free == 0:  # every admission needs at least one new block
                break
            if self._outgrows_cap(seq, seq.num_tokens):
                self._fail(seq, out)
                continue
            computed = self.kv.get_computed_blocks(seq)
            if self._next_block_hash(seq, len(computed)) in in_flight:
                continue  # a running sequence is computing this very block: hit it next step
            n = min(seq.num_tokens - len(computed) * self.block_size, budget)
            growth, from_free = self.kv.blocks_needed(seq, n, computed)
            if seq.is_long and self._long_blocks_held() + growth > self.long_cap_blocks:
                continue
            if from_free > self.kv.pool.num_free:
                skips = self._skips[seq.request_id] = self._skips.get(seq.request_id, 0) + 1
                if skips >= HEAD_SKIP_LIMIT:
                    break
                continue
            ok = self.kv.allocate_slots(seq, n, computed)
            assert ok, "scheduler bug: admission allocation failed"
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self._skips.pop(seq.request_id, None)
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n
            in_flight |= {self._next_block_hash(seq)} - {None}

    def _next_block_hash(self, seq: Sequence, index: int | None = None) -> bytes | None:
        """Hash of block ``index`` (default: the block holding ``seq``'s first uncomputed
        token) when the prefix cache is on and that block is full of tokens, else None."""
        if index is None:
            index = seq.num_computed_tokens // self.block_size
        full = (index + 1) * self.block_size <= seq.num_tokens
        if not (self.kv.prefix.enabled and full and index <= len(seq.block_hashes)):
            return None
        return self.kv.prefix.block_hash(seq, index)[0]

    def _long_blocks_held(self) -> int:
        return sum(len(s.block_table) for s in self.running if s.is_long)

    # ------------------------------------------------------------------ after the model ran

    def advance(self, output: SchedulerOutput) -> None:
        """Mark the chunks' tokens computed and cache newly full blocks (after the forward)."""
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = chunk.start + chunk.num_new_tokens
            self.kv.cache_full_blocks(seq)

    def check_invariants(self) -> None:
        """Assert the bookkeeping invariants (tests and debug mode; O(blocks + sequences)).

        The pool's accounting (pool.py); each block's refcount equals the number of block tables
        holding it; a running table covers its computed tokens; waiting sequences hold nothing;
        long requests stay within their share.
        """
        pool = self.kv.pool
        pool.check_invariants()
        holders = [0] * pool.num_blocks
        for seq in self.running:
            assert seq.status is SequenceStatus.RUNNING
            assert len(seq.block_table) * self.block_size >= seq.num_computed_tokens
            for block_id in seq.block_table:
                holders[block_id] += 1
        assert [b.ref_cnt for b in pool.blocks] == holders, "refcount != block-table holders"
        for seq in self.waiting:
            assert seq.status is SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        assert len(self.running) <= self.config.max_num_seqs
        assert self._long_blocks_held() <= self.long_cap_blocks

    def stats(self) -> dict:
        """KV pool and queue figures (names as in the issue; kv_usage = in-use / total)."""
        pool = self.kv.pool
        return {
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_free": pool.num_free,
            "kv_blocks_cached": pool.num_cached,
            "kv_usage": pool.num_in_use / pool.num_blocks,
            "kv_bytes_per_block": self.bytes_per_block,
            "prefix_cache_queried_tokens": self.kv.prefix.queried_tokens,
            "prefix_cache_hit_tokens": self.kv.prefix.hit_tokens,
            "num_preemptions": self.num_preemptions,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
        }
