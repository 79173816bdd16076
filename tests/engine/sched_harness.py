"""A fake model and KV memory to drive the Scheduler in tests, checking bookkeeping every step.

The fake model's next token is a pure function of the whole token prefix, like greedy decoding
of a real model, so its outputs do not depend on batching, chunking, preemption or prefix hits:
``reference_output`` computes them without any scheduler, as the oracle.

The fake KV memory stores at each written slot a fingerprint of the prefix that produced it.
Before a chunk runs, every earlier position of the sequence is read through its block table
and must hold exactly that prefix's fingerprint: this catches a block freed or reused while
still referenced, a wrong prefix-cache hit, a cached block evicted but still handed out, and a
shared block overwritten.
"""

from __future__ import annotations

from kvledger.engine.config import EngineConfig
from kvledger.engine.request import Request, RequestStatus
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.engine.sched.output import SchedulerOutput
from kvledger.engine.sched.scheduler import Scheduler

VOCAB = 50
EOS = 0


def next_token(tokens: list[int]) -> int:
    """The fake model's greedy token after ``tokens`` (EOS now and then)."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 7 + len(tokens)) % VOCAB


def reference_output(prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """What the fake model generates alone with unlimited memory."""
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(next_token(prompt + out))
        if out[-1] == EOS and not ignore_eos:
            break
    return out


def prefix_fingerprints(tokens: list[int]) -> list[int]:
    """fingerprints[pos] identifies ``tokens[: pos + 1]`` (what a real K/V at pos depends on)."""
    out, fp = [], 0
    for t in tokens:
        fp = hash((fp, t))
        out.append(fp)
    return out


class Harness:
    """Scheduler + fake model + fake KV memory + invariant checks."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int = 4096, **options):
        self.config = EngineConfig(block_size=block_size, **options)
        self.sched = Scheduler(self.config, num_blocks, block_size, 1000, max_model_len)
        self.bs = block_size
        self.memory: dict[int, int] = {}
        self.reqs: dict[str, Request] = {}
        self.aborted: set[str] = set()
        self.steps = 0
        self.peak_usage = 0.0
        self.max_long_blocks = 0
        self.taken = [0] * num_blocks  # references handed out per block (allocate + touch)
        self.dropped = [0] * num_blocks  # references given back per block (free)
        self._count_references()

    def _count_references(self) -> None:
        pool = self.sched.kv.pool
        allocate, touch, free = pool.allocate, pool.touch, pool.free

        def counted_allocate(n):
            block_ids = allocate(n)
            for b in block_ids:
                self.taken[b] += 1
            return block_ids

        def counted(method, tally):
            def wrapper(block_ids):
                block_ids = list(block_ids)
                method(block_ids)
                for b in block_ids:
                    tally[b] += 1

            return wrapper

        pool.allocate = counted_allocate
        pool.touch = counted(touch, self.taken)
        pool.free = counted(free, self.dropped)

    def add(
        self,
        rid: str,
        prompt: list[int],
        max_tokens: int | None,
        salt: str | None = None,
        ignore_eos: bool = True,
    ) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        req = Request(rid, list(prompt), params, cache_salt=salt)
        self.sched.add(req)
        self.reqs[rid] = req
        return req

    def abort(self, rid: str) -> None:
        assert self.sched.abort(rid) is self.reqs[rid]
        self.aborted.add(rid)

    def slot(self, req: Request, pos: int) -> int:
        return req.block_table[pos // self.bs] * self.bs + pos % self.bs

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.steps += 1
        self.check(out)
        for chunk in out.chunks:
            req, fingerprints = chunk.request, prefix_fingerprints(chunk.request.all_token_ids)
            for pos in range(chunk.start):
                assert self.memory[self.slot(req, pos)] == fingerprints[pos], pos
            for pos in range(chunk.start, chunk.start + chunk.num_new_tokens):
                self.memory[self.slot(req, pos)] = fingerprints[pos]
        self.sched.advance(out)
        for chunk in out.chunks:
            req = chunk.request
            if chunk.samples:
                req.output_token_ids.append(next_token(req.all_token_ids))
                done = len(req.output_token_ids) >= req.max_tokens_effective
                if done or (req.output_token_ids[-1] == EOS and not req.params.ignore_eos):
                    self.sched.finish(req)
        self.check_state()
        return out

    def run(self, max_steps: int = 5000) -> None:
        """Step until idle; more than ``max_steps`` steps means a livelock."""
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("no progress: scheduler did not drain")

    def check(self, out: SchedulerOutput) -> None:
        """A step's chunks: budgets respected, one chunk per sequence, slots allocated."""
        cfg = self.config
        assert len(out.chunks) <= cfg.max_num_seqs
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        for c in out.chunks:
            assert c.num_new_tokens >= 1 and c.request.status is RequestStatus.RUNNING
            assert len(c.request.block_table) * self.bs >= c.start + c.num_new_tokens
            assert c.start + c.num_new_tokens <= c.request.num_tokens
        for req, error in out.failed:
            self.aborted.add(req.request_id)
            assert req.status is RequestStatus.FINISHED and req.block_table == []
            assert "KV pool" in str(error)

    def check_state(self) -> None:
        """The scheduler's own invariant check, plus a block appears once per table."""
        sched = self.sched
        sched.check_invariants()
        for rid, req in self.reqs.items():  # one definition of unfinished: in the registry
            assert (rid in sched.requests) == (not req.is_finished), rid
        for req in sched.running:
            assert len(set(req.block_table)) == len(req.block_table)
        long_blocks = sum(len(s.block_table) for s in sched.running if s.is_long)
        self.max_long_blocks = max(self.max_long_blocks, long_blocks)
        self.peak_usage = max(self.peak_usage, sched.stats()["kv_usage"])

    def assert_idle(self) -> None:
        """At idle every block is free (possibly cached) and every output is the oracle's."""
        stats = self.sched.stats()
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert self.sched.requests == {} and not self.sched.has_unfinished_requests()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert stats["kv_usage"] == 0.0
        assert all(b.ref_cnt == 0 for b in self.sched.kv.pool.blocks)
        assert self.taken == self.dropped  # every reference returned exactly once
        for rid, req in self.reqs.items():
            assert req.status is RequestStatus.FINISHED and req.block_table == []
            expected = reference_output(
                req.prompt_token_ids, req.max_tokens_effective, req.params.ignore_eos
            )
            if rid in self.aborted:
                expected = expected[: len(req.output_token_ids)]
            assert req.output_token_ids == expected, rid
