"""Scheduler: continuous batching over the paged KV cache (seed §4.3, §3.4, §5.3).

Each ``schedule()`` builds one step of at most ``max_num_batched_tokens`` tokens and
``max_num_seqs`` requests, and allocates every slot the step writes before returning:

1. Running requests, oldest first: decodes (1 token each) before continuing chunked prefills
   (``min(remaining, budget left)`` tokens, shrunk to the free blocks), so streams keep flowing
   while a long prompt is prefilled. While requests wait, the continuing prefills leave
   ``new_prefill_tokens`` of the budget (default a quarter) to them, as vLLM's chunked prefill
   shares its budget between partial and new prefills: a short prompt arriving behind a long
   one is admitted at the next step and samples its first token there (when blocks and
   ``max_num_seqs`` allow), instead of after the long prompt's last chunk.
2. If nothing was preempted this step, waiting requests FCFS: prefix-cache lookup, then the first
   chunk ``min(remaining, budget left)``. A request whose first block missing from the cache is
   the very block a running request is computing now (same hash: e.g. a burst of requests with
   one system prompt) waits a step and then hits it instead of computing it twice. A request
   whose chunk does not fit the free blocks now is skipped so a later smaller one can start (no
   head-of-line blocking); on a model with sliding layers, whose chunk of C makes each sliding
   group hold W + C - 1 positions, it starts with the part that fits instead. Starvation guard: once
   a waiting request has been passed over for lack of blocks in ``HEAD_SKIP_LIMIT`` steps,
   nothing behind it is admitted until it is; running requests finish and free blocks, so it
   gets in. (Being held back by the long-request share does not count: admitting short requests
   behind a capped long one does not delay it.)

Preemption by recompute: when a running request cannot get a block for its next token, the
newest running request (possibly itself) loses all its blocks, restarts at
``num_computed_tokens = 0`` and goes to the FRONT of the waiting queue, keeping its output
tokens. "Newest" counts every running request, also one already scheduled in this step (decodes
are scheduled before prefills): its chunk is taken back out of the step and its tokens returned
to the budget, so an older prefill never preempts itself while a newer decode keeps its blocks
(the recompute thrash of vLLM issue #25538). Invariant: a request is preempted only when every
running request admitted after it has been; on resume prompt + output is prefilled again and its full blocks are usually
re-hit in the prefix cache (they were freed tail-first, so they are evicted last).

Admission rule (``ledger/admission.py``, the one place it is computed): ``add`` refuses at once
a request whose prompt + max_tokens passes the context (ContextLengthError), the per-request
quota, or whose largest KV (prompt + max_tokens - 1 tokens: the last sampled token is never fed
back) exceeds the pool or its long-request share (KVBudgetError); ``max_tokens=None`` means up
to that limit. No deadlock, no livelock: any admitted request fits when alone, and a step with
running requests always schedules at least one chunk. Preemption only removes requests admitted
after the one that needs the block, so the oldest running request is never preempted and keeps
progressing. A request that outgrows what it may ever hold (only possible
when the engine runs it past ``max_tokens_effective``) is failed (``SchedulerOutput.failed``)
instead of being preempted and retried forever.

Bookkeeping: ``requests`` (id -> Request) is the engine's one registry of live requests; a
request is in it exactly while it is in ``waiting`` or ``running``.

Long/short isolation (seed §3.4): requests whose prompt has >= ``long_prompt_tokens`` tokens may
hold together at most ``floor(long_kv_share * num_blocks)`` block-table entries (a shared prefix
block counts once per holder, so the cap is conservative).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvledger.engine.config import EngineConfig
from kvledger.engine.kv.events.recorder import CacheEvents
from kvledger.engine.kv.manager import ONE_TABLE, KVCacheManager
from kvledger.engine.kv.pool import BlockPool
from kvledger.engine.kv.prefix import PrefixCache
from kvledger.engine.kv.store import KVStore
from kvledger.engine.kv.tiers.link import TierLink
from kvledger.engine.kv.tiers.tier import cached_by_tier
from kvledger.engine.request import Request, RequestStatus
from kvledger.engine.sched.invariants import check_invariants
from kvledger.engine.sched.max_tokens import max_tokens_effective
from kvledger.engine.sched.output import ScheduledChunk, SchedulerOutput
from kvledger.engine.sched.snapshot import (
    PoolStats,
    SchedulerSnapshot,
    pool_stats,
    scheduler_stats,
    take_snapshot,
)
from kvledger.errors import InvalidParameterError, KVBudgetError
from kvledger.ledger.admission import RequestBudget
from kvledger.ledger.kv_groups import KVGroup, is_hybrid

HEAD_SKIP_LIMIT = 32
"""Steps a waiting request may be passed over for lack of blocks before admission stops
behind it."""


class Scheduler:
    """Continuous-batching scheduler over a KVCacheManager; owns the live requests.

    Args:
        config: engine options (budgets, prefix caching, long/short isolation, quota).
        num_blocks: KV pool size in blocks (sized by the ledger).
        block_size: tokens per block.
        bytes_per_block: KV bytes of one block over all layers (the ledger's figure; for
            messages and stats).
        max_model_len: the model's context limit in tokens.
        store, groups, sealed_blocks, shareable, intact_blocks, on_release, link_tiers,
            events, state_slots: the KV manager's (``KVCacheManager``; it may keep
            ``max_num_seqs`` sequences' intact blocks cached).
    """

    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        block_size: int,
        bytes_per_block: int,
        max_model_len: int,
        store: KVStore | None = None,
        groups: tuple[KVGroup, ...] = ONE_TABLE,
        sealed_blocks: Callable[[int], int] | None = None,
        shareable: Callable[[list[int]], int] = len,
        intact_blocks: int = 0,
        on_release: Callable[[int], None] | None = None,
        link_tiers: Callable[[BlockPool, PrefixCache], TierLink] | None = None,
        events: CacheEvents | None = None,
        state_slots=None,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, store,
                                 groups, sealed_blocks, shareable, intact_blocks,
                                 config.max_num_seqs * intact_blocks, on_release, link_tiers,
                                 events, state_slots)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        quota = config.max_kv_tokens_per_request
        paged = groups if is_hybrid(groups) or groups[0].window else ()  # else ceil(n / B)
        self.budget = RequestBudget(block_size, num_blocks, max_model_len, quota, paged)
        long_blocks = int(config.long_kv_share * num_blocks)  # used only with long_prompt_tokens
        self.long_budget = RequestBudget(block_size, long_blocks, max_model_len, quota, paged)

    # ------------------------------------------------------------------ requests in and out

    def budget_for(self, num_prompt_tokens: int) -> RequestBudget:
        """The admission budget of a request with this prompt length (long or short)."""
        long_tokens = self.config.long_prompt_tokens
        is_long = long_tokens is not None and num_prompt_tokens >= long_tokens
        return self.long_budget if is_long else self.budget

    def add(self, req: Request) -> None:
        """Queue a request (FCFS) after resolving its ``max_tokens_effective``.

        Raises:
            InvalidParameterError: its id is already live.
            ContextLengthError: prompt + max_tokens passes the context (or the prompt leaves no
                room for one new token).
            KVBudgetError: it can never fit: prompt + max_tokens passes
                ``max_kv_tokens_per_request``, or its largest KV exceeds the pool (or the
                long-request share of it).
        """
        if req.request_id in self.requests:
            raise InvalidParameterError(f"request id {req.request_id!r} is already running")
        budget = self.budget_for(req.num_prompt_tokens)
        req.is_long = budget is self.long_budget
        req.max_tokens_effective = max_tokens_effective(req, budget, self.bytes_per_block)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.requests[req.request_id] = req

    def finish(self, req: Request) -> None:
        """Free ``req``'s blocks tail-first and mark it FINISHED (EOS, stop, length, error)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        del self.requests[req.request_id]

    def abort(self, request_id: str) -> Request | None:
        """Finish the request in whatever state it is (also mid chunked prefill); None if unknown."""
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req)
        return req

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running: the one definition of unfinished."""
        return bool(self.requests)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks and allocate their slots (see the module docstring)."""
        out = SchedulerOutput()
        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        full = self.config.max_num_batched_tokens
        prefill_cap = full - self.config.prefill_reserve if self.waiting else full
        for req in decodes + prefills:
            budget = (full if req.num_uncomputed_tokens == 1 else prefill_cap) \
                - out.num_batched_tokens
            if budget <= 0:  # decodes come first: no prefill after this one finds any either
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            n = self._grow(req, min(req.num_uncomputed_tokens, budget, req.retention.chunk_tokens),
                           out)
            if n:
                out.chunks.append(ScheduledChunk(req, n))
        budget = self.config.max_num_batched_tokens - out.num_batched_tokens
        if not out.preempted:
            self._admit(budget, out)
        return out

    def _grow(self, req: Request, n: int, out: SchedulerOutput) -> int:
        """Tokens of ``req``'s next chunk that get slots (<= n), preempting newer requests as
        needed (a scheduled one loses its chunk in ``out``); 0 when ``req`` itself was
        preempted or failed."""
        if not self._budget(req).holds_kv_tokens(req.num_kv_slots + 1):
            self._fail(req, out)
            return 0
        while True:
            fit = self._tokens_that_fit(req, n)
            if fit == n or (fit > 0 and n > 1):
                ok = self.kv.allocate_slots(req, fit)
                assert ok, "scheduler bug: tokens fit but allocation failed"
                return fit
            victim = self._victim(req)
            # Alone, a request within its cap always fits: the rest of the pool is free.
            assert victim is not req or len(self.running) > 1, "scheduler bug: lone request"
            self._preempt(victim, out)
            if victim is req:
                return 0

    def extend_chunk(self, out: SchedulerOutput, chunk: ScheduledChunk, k: int) -> int:
        """Give the scheduled one-token decode ``chunk`` up to ``k`` more slots (a speculative
        verify, ``engine/spec/``) within the step's token budget and the free blocks, never
        preempting; returns how many it got."""
        req = chunk.request
        k = min(k, self.config.max_num_batched_tokens - out.num_batched_tokens)
        n = self._tokens_that_fit(req, chunk.num_new_tokens + k) if k > 0 else 0
        if n <= chunk.num_new_tokens:
            return 0
        ok = self.kv.allocate_slots(req, n)
        assert ok, "scheduler bug: tokens fit but allocation failed"
        return n - chunk.num_new_tokens

    def _budget(self, req: Request) -> RequestBudget:
        """The budget ``req`` was admitted under (its long flag is fixed at ``add``)."""
        return self.long_budget if req.is_long else self.budget

    def _tokens_that_fit(self, req: Request, n: int) -> int:
        """Most of the next ``n`` tokens of a running ``req`` that the free blocks can hold."""
        free_blocks = self.kv.pool.num_free
        if req.is_long:
            free_blocks = min(free_blocks, self.long_budget.max_blocks - self._long_blocks_held())
        return self.kv.tokens_that_fit(req, n, free_blocks)

    def _victim(self, req: Request) -> Request:
        """Newest running request, scheduled in this step or not (long ones only if ``req`` is
        long and the long share, not the pool, is what ran out); ``req`` itself when no
        eligible one is newer."""
        long_only = req.is_long and self.kv.pool.num_free > 0
        for cand in reversed(self.running):
            if cand is req:
                return req
            if cand.is_long or not long_only:
                return cand
        return req

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        out.chunks = [c for c in out.chunks if c.request is not req]  # unschedule it
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        out.preempted.append(req)

    def _fail(self, req: Request, out: SchedulerOutput) -> None:
        error = KVBudgetError(
            f"request {req.request_id!r} cannot grow past {req.num_computed_tokens} tokens: "
            f"the KV pool ({self.kv.pool.num_blocks} blocks of {self.block_size} tokens"
            f"{', long-request share ' + str(self.long_budget.max_blocks) if req.is_long else ''}) "
            "is too small; lower max_tokens or raise --kv-cache-gib / --num-blocks"
        )
        self.finish(req)
        out.failed.append((req, error))

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        """Admit waiting requests FCFS without head-of-line blocking (module docstring)."""
        if not self.waiting:
            return
        prefilling = [r for r in self.running if r.num_uncomputed_tokens > 1]
        in_flight = {self._next_block_hash(r) for r in prefilling} - {None}
        for req in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self.kv.pool.num_free == 0:  # every admission needs at least one new block
                break
            if not self._budget(req).holds_kv_tokens(self._resume_kv_tokens(req)):
                self._fail(req, out)
                continue
            hit_blocks = self.kv.find_longest_cache_hit(req)
            if self._next_block_hash(req, len(hit_blocks[0])) in in_flight:
                continue  # a running request is computing this very block: hit it next step
            n = min(req.num_tokens - len(hit_blocks[0]) * self.block_size, budget,
                    req.retention.chunk_tokens)
            growth, from_free = self.kv.blocks_needed(req, n, hit_blocks)
            if from_free > self.kv.pool.num_free and self.kv.sliding:
                # a chunk makes a sliding group hold W + C - 1 positions, more than the request
                # holds between steps: admit the part that fits (a lone request always fits)
                n = self.kv.tokens_that_fit(req, n, self.kv.pool.num_free, hit_blocks) or n
                growth, from_free = self.kv.blocks_needed(req, n, hit_blocks)
            if req.is_long and self._long_blocks_held() + growth > self.long_budget.max_blocks:
                continue
            if from_free > self.kv.pool.num_free:
                req.num_skips += 1
                if req.num_skips >= HEAD_SKIP_LIMIT:
                    break
                continue
            ok = self.kv.allocate_slots(req, n, hit_blocks)
            assert ok, "scheduler bug: admission allocation failed"
            if req.num_preemptions == 0:
                req.num_cached_tokens = req.num_computed_tokens
                if self.kv.tiers is not None:
                    req.cached_tokens_by_tier = cached_by_tier(req, len(hit_blocks[0]),
                                                               self.block_size)
            req.num_skips = 0
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            out.chunks.append(ScheduledChunk(req, n))
            budget -= n
            in_flight |= {self._next_block_hash(req)} - {None}

    @staticmethod
    def _resume_kv_tokens(req: Request) -> int:
        """Most K/V slots ``req`` holds at once while it computes its ``num_tokens`` tokens
        (all of them under full retention: a preempted request prefills its output again)."""
        return req.retention.spec.max_kv_tokens(req.num_prompt_tokens, req.num_tokens + 1)

    def _next_block_hash(self, req: Request, index: int | None = None) -> bytes | None:
        """Hash of block ``index`` (default: the block holding ``req``'s first uncomputed
        token) when the prefix cache is on and that block is full of tokens, else None."""
        if index is None:
            index = req.num_computed_tokens // self.block_size
        full = (index + 1) * self.block_size <= req.num_tokens
        if not (self.kv.prefix.enabled and full and index <= len(req.block_hashes)):
            return None
        return self.kv.prefix.block_hash(req, index)[0]

    def _long_blocks_held(self) -> int:
        return sum(r.num_blocks_held for r in self.running if r.is_long)

    # ------------------------------------------------------------------ after the model ran

    def advance(self, output: SchedulerOutput) -> None:
        """Mark the chunks' tokens computed and cache newly full blocks (after the forward)."""
        for chunk in output.chunks:
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens = chunk.start + chunk.num_new_tokens
            req.retention.append(chunk.start, chunk.num_new_tokens)
            self.kv.cache_full_blocks(req)
            self.kv.retain(req)  # an evicting policy drops tokens and gives back blocks

    def check_invariants(self) -> None:
        """Assert the bookkeeping invariants (``invariants.py``; tests and debug mode)."""
        check_invariants(self)

    def snapshot(self) -> SchedulerSnapshot:
        """The pool and the queues as a frozen read model (``snapshot.py``)."""
        return take_snapshot(self)

    def pool_stats(self) -> PoolStats:
        """The pool's block counts and sizes as a frozen read model (``snapshot.py``)."""
        return pool_stats(self)

    def stats(self) -> dict:
        """KV pool and queue figures (``snapshot.scheduler_stats``)."""
        return scheduler_stats(self)
