"""Replay a trace through the engine's own Scheduler and KV cache manager in simulated time.

No model runs: the same ``Scheduler`` object the engine builds (admission rule, prefix cache,
chunked prefill, preemption, quotas, long/short isolation) schedules every step; a *clock*
says when the step starts and how long it lasts. After each step the replay does what
``LLMEngine.step`` does with the model's output: ``Scheduler.advance``, one token appended to
every chunk that reached its request's end, and ``Scheduler.finish`` for a request that reached
its output length (from the trace) or its ``max_tokens_effective``.

Loop: requests whose (speed-scaled) arrival is at or before the step's start are added first,
in arrival order, as the server's engine thread adds the requests that came in since the last
step; with nothing to do the clock jumps to the next arrival. Request times follow the engine's
stamps (server-side, as ``/metrics`` defines them): arrival = when the engine adds the request
(the start of the first step at or after its arrival: the engine stamps it in ``add_request``,
so a request that comes in during a step does not count that step's remainder), first
scheduled = the step's start, first and later tokens = the step's end.

Token ids: a trace with ``prompt_token_ids`` is replayed with them (and with the recorded
``output_token_ids``, so generated blocks hit the prefix cache as they did live). A private
trace's prompt is rebuilt from its block hashes: block ``i`` gets tokens derived from its
hash, so two requests share exactly the prefix blocks whose hashes they share; the partial
last block and the output get tokens unique to the request. A trace without either (an
imported one) shares nothing.

Retention: a request under an evicting ``--kv-policy`` (the engine's default, or the one its
trace ``sampling`` names) gets the engine's retention state, so the Scheduler frees and compacts
its blocks after each step as the engine does (:mod:`kvledger.replay.retention`: exact for
window and sinks; for h2o and snapkv exact while the replay follows a recorded schedule whose
evictions the trace holds, else a score-free stand-in that predicts the block accounting only).

Clocks: :class:`ModelClock` (the step-time model, back to back) and :class:`RecordedClock`
(each step starts and lasts as the trace's step of the same index did; this reproduces a
recorded run's schedule when the replay's scheduler is the live one).
"""

from __future__ import annotations

import hashlib
import random
from collections import deque
from dataclasses import dataclass, field

from kvledger.engine.config import EngineConfig
from kvledger.engine.request import Request
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.engine.sched.output import SchedulerOutput
from kvledger.engine.sched.scheduler import Scheduler
from kvledger.errors import ContextLengthError, KVBudgetError
from kvledger.ledger.retention import RetentionSpec
from kvledger.ledger.step_model import StepFeatures, StepTimeModel
from kvledger.replay.retention import NoKVStore, ReplayedPolicy, positions_of, retained_kv
from kvledger.replay.trace import Trace, TraceRequest

TOKEN_RANGE = 1 << 30  # synthetic token ids; the scheduler never looks them up in a vocabulary


class ModelClock:
    """Steps back to back, each lasting what the step-time model says."""

    def __init__(self, model: StepTimeModel) -> None:
        self.model = model

    def start(self, index: int, now: float) -> float:
        """When step ``index`` starts, the previous one having ended at ``now``."""
        return now

    def duration(self, index: int, plan: SchedulerOutput) -> float:
        """Seconds step ``index`` lasts."""
        return self.model.duration(StepFeatures.of_plan(plan))


class RecordedClock:
    """Step ``i`` starts at the recorded start (or ``now`` if later) and lasts the recorded
    duration; steps past the recording fall back to ``fallback`` (or last 0 s)."""

    def __init__(self, steps: list[dict], fallback: ModelClock | None = None) -> None:
        self.steps, self.fallback = steps, fallback

    def start(self, index: int, now: float) -> float:
        if index < len(self.steps):
            return max(now, self.steps[index]["start_s"])
        return now

    def duration(self, index: int, plan: SchedulerOutput) -> float:
        if index < len(self.steps):
            return self.steps[index]["duration_s"]
        return self.fallback.duration(index, plan) if self.fallback else 0.0


@dataclass
class SimRequest:
    """One replayed request: its trace entry, its engine Request, and what happened to it."""

    trace: TraceRequest
    arrival_s: float
    target_output: int | None
    request: Request | None = None
    refused: str | None = None
    added_s: float | None = None  # when the engine added it: its server-side arrival stamp
    first_scheduled_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_s: float | None = None
    output_ids: list[int] = field(default_factory=list)
    live_policy: bool = False  # replayed under the policy it ran under live

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.added_s if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.added_s

    @property
    def queue_s(self) -> float | None:
        s = self.first_scheduled_s
        return None if s is None else s - self.added_s


@dataclass
class ReplayRun:
    """What a replay produced: requests (trace order), steps, KV peak, the pool it ran on."""

    requests: list[SimRequest]
    steps: list[dict]
    num_blocks: int
    bytes_per_block: int
    kv_peak_blocks: int
    preemptions: int
    end_s: float


def _hash_tokens(seed: bytes, n: int) -> list[int]:
    rng = random.Random(hashlib.sha256(seed).digest())
    return [rng.randrange(TOKEN_RANGE) for _ in range(n)]


def prompt_ids(req: TraceRequest, hash_block_size: int | None) -> list[int]:
    """The prompt token ids to replay (see the module docstring)."""
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    ids: list[int] = []
    for h in req.block_hashes or []:
        ids += _hash_tokens(bytes.fromhex(h), hash_block_size)
    return ids + _hash_tokens(f"tail:{req.id}".encode(), req.prompt_tokens - len(ids))


class Simulator:
    """Drives a Scheduler through a trace (see the module docstring).

    Args:
        trace: the workload.
        config: engine options (budgets, prefix caching, isolation, quota).
        num_blocks: KV pool blocks; bytes_per_block: the ledger's bytes per block.
        max_model_len: the model's context.
        clock: ModelClock or RecordedClock.
        speed: arrival-time divisor (2 = twice the load); the step times do not change.
        live_retention: the recording engine's default retention policy (None: unknown), which
            decides whether the trace's recorded evictions apply to a request.
    """

    def __init__(self, trace: Trace, config: EngineConfig, num_blocks: int,
                 bytes_per_block: int, max_model_len: int, clock, speed: float = 1.0,
                 live_retention: RetentionSpec | None = None) -> None:
        self.trace, self.clock, self.config = trace, clock, config
        self.live_retention = live_retention
        self.sched = Scheduler(config, num_blocks, config.block_size, bytes_per_block,
                               max_model_len, NoKVStore())
        self.in_sync = True  # every step so far computed what the trace's step of its index did
        self.bytes_per_block = bytes_per_block
        self.hash_block_size = trace.header.get("hash_block_size")
        self.sims = [SimRequest(r, r.arrival_s / speed, r.target_output_tokens)
                     for r in trace.requests]

    def _add(self, sim: SimRequest, now: float) -> None:
        r = sim.trace
        sim.added_s = now
        params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
        named = r.sampling.get("kv_policy")
        spec = RetentionSpec.from_dict(named) if named else self.config.retention
        req = Request(r.id, prompt_ids(r, self.hash_block_size), params,
                      retention=retained_kv(spec, self.config.block_size))
        sim.live_policy = spec == (RetentionSpec.from_dict(named) if named else
                                   self.live_retention)
        try:
            self.sched.add(req)
        except (ContextLengthError, KVBudgetError) as exc:
            sim.refused = ("context: " if isinstance(exc, ContextLengthError) else "kv: ") + str(exc)
            return
        sim.request = req
        recorded = (r.finish or {}).get("output_token_ids")
        sim.output_ids = list(recorded) if recorded else []

    def _next_token(self, sim: SimRequest) -> int:
        n = len(sim.request.output_token_ids)
        if n < len(sim.output_ids):
            return sim.output_ids[n]
        return _hash_tokens(f"out:{sim.trace.id}:{n}".encode(), 1)[0]

    def run(self) -> ReplayRun:
        """Replay every request; returns the run (deterministic for a trace and options)."""
        pending = deque(sorted(self.sims, key=lambda s: s.arrival_s))
        by_id = {s.trace.id: s for s in self.sims}
        steps: list[dict] = []
        now, peak = 0.0, 0
        while pending or self.sched.has_unfinished_requests():
            if not self.sched.has_unfinished_requests() and pending[0].arrival_s > now:
                now = pending[0].arrival_s
            start = self.clock.start(len(steps), now)
            while pending and pending[0].arrival_s <= start:
                self._add(pending.popleft(), start)
            if not self.sched.has_unfinished_requests():
                now = start
                continue
            plan = self.sched.schedule()
            for req, err in plan.failed:
                by_id[req.request_id].refused = f"failed: {err}"
            if not plan.chunks:
                now = pending[0].arrival_s if pending else start
                continue
            peak = max(peak, self.sched.pool_stats().blocks_in_use)
            duration = self.clock.duration(len(steps), plan)
            end = start + duration
            steps.append({"index": len(steps), "start_s": start, "duration_s": duration,
                          "chunks": [[c.request.request_id, c.start, c.num_new_tokens]
                                     for c in plan.chunks],
                          "preempted": [r.request_id for r in plan.preempted],
                          "failed": [r.request_id for r, _ in plan.failed]})
            for chunk in plan.chunks:
                sim = by_id[chunk.request.request_id]
                sim.first_scheduled_s = sim.first_scheduled_s if sim.first_scheduled_s is not \
                    None else start
            self._recorded_evictions(len(steps) - 1, plan, by_id)
            self.sched.advance(plan)
            for chunk in plan.chunks:
                if chunk.samples:
                    self._append(by_id[chunk.request.request_id], end)
            now = end
        return ReplayRun(self.sims, steps, self.sched.pool_stats().blocks_total,
                         self.bytes_per_block, peak, self.sched.num_preemptions, now)

    def _recorded_evictions(self, index: int, plan: SchedulerOutput, by_id: dict) -> None:
        """Give each token-level policy of this step the positions the engine dropped at the
        trace's step ``index``, while the replay computes what the trace did (else None: the
        stand-in selection)."""
        live = self.trace.steps[index] if index < len(self.trace.steps) else None
        ours = [[c.request.request_id, c.start, c.num_new_tokens] for c in plan.chunks]
        self.in_sync = self.in_sync and live is not None and "evicted" in live and \
            [list(c) for c in live["chunks"]] == ours
        evicted = {rid: positions_of(runs) for rid, runs in (live or {}).get("evicted", [])}
        for chunk in plan.chunks:
            state = chunk.request.retention
            if isinstance(state.policy, ReplayedPolicy):
                exact = self.in_sync and by_id[chunk.request.request_id].live_policy
                state.policy.recorded = evicted.get(chunk.request.request_id, set()) \
                    if exact else None

    def _append(self, sim: SimRequest, end: float) -> None:
        req = sim.request
        req.output_token_ids.append(self._next_token(sim))
        sim.token_times.append(end)
        n = len(req.output_token_ids)
        target = sim.target_output if sim.target_output is not None else req.max_tokens_effective
        if n >= min(max(target, 1), req.max_tokens_effective):
            sim.finished_s = end
            self.sched.finish(req)
