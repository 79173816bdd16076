"""Record a live engine's requests and steps as a trace (``kvledger serve --trace``).

:class:`TracingEngine` wraps an ``LLMEngine`` and forwards every call to it; ``add_request``,
``step`` and ``abort`` also write trace lines (:mod:`kvledger.replay.trace`). Everything else
(attributes, ``stats``, ``tokenize``) reaches the engine unchanged, so the server's engine
thread drives the wrapper exactly as it drives the engine. Times are ``time.perf_counter()``
seconds minus the wrapper's creation time, the clock the engine stamps its request metrics
with.

Under a token-level retention policy (h2o, snapkv) the request's policy object is wrapped in
:class:`RecordingPolicy`, which passes every decision through unchanged and notes the positions
it dropped; each ``step`` line carries them as ``evicted`` (what lets a replay keep exactly the
tokens the engine kept, :mod:`kvledger.replay.retention`). Nothing else of the engine changes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import KVLedgerError
from kvledger.ledger.retention import RetentionSpec
from kvledger.replay.retention import dropped_ranges
from kvledger.replay.trace import TraceWriter

_DEFAULTS = SamplingParams()


def sampling_fields(params: SamplingParams) -> dict:
    """The sampling options that differ from SamplingParams' defaults (max_tokens apart)."""
    out = {}
    for f in dataclasses.fields(SamplingParams):
        value = getattr(params, f.name)
        if f.name != "max_tokens" and value != getattr(_DEFAULTS, f.name):
            out[f.name] = dataclasses.asdict(value) if isinstance(value, RetentionSpec) else value
    return out


class RecordingPolicy:
    """A live request's retention policy that notes what its ``keep`` drops.

    Every attribute is the wrapped policy's; ``keep`` returns the policy's answer and appends
    ``(request id, dropped positions)`` to ``log``.
    """

    def __init__(self, inner, request_id: str, log: list) -> None:
        self.inner, self.request_id, self.log = inner, request_id, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def keep(self, pos, scores, next_pos, num_prompt_tokens, compressed):
        """The wrapped policy's bool mask over ``pos`` ([h], or [rows, h] per head); notes
        ``pos[~mask]`` (per head: the first row's, the count every row drops)."""
        kept = self.inner.keep(pos, scores, next_pos, num_prompt_tokens, compressed)
        if not bool(kept.all()):
            first_pos, first_kept = (pos, kept) if pos.dim() == 1 else (pos[0], kept[0])
            self.log.append((self.request_id, sorted(first_pos[~first_kept].tolist())))
        return kept


class TracingEngine:
    """An ``LLMEngine`` that writes its requests and steps to a trace.

    Args:
        engine: the engine to drive (only the calling thread touches it, as before).
        writer: where the lines go (its ``private`` flag decides token ids vs hashes).
    """

    def __init__(self, engine: Any, writer: TraceWriter) -> None:
        self._engine = engine
        self._writer = writer
        self._t0 = time.perf_counter()
        self._live: dict[str, Any] = {}  # id -> Request, for its figures at finish
        self._steps = 0
        self._evicted: list[tuple[str, list[int]]] = []  # this step's drops (RecordingPolicy)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def _t(self, perf: float) -> float:
        return round(perf - self._t0, 6)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        """``LLMEngine.add_request``; writes a ``request`` line, or ``refused`` if it raises."""
        try:
            self._engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
        except KVLedgerError as exc:
            self._writer.write({"type": "refused", "id": request_id,
                                "arrival_s": self._t(time.perf_counter()), "error": str(exc)})
            raise
        req = self._engine.scheduler.requests[request_id]
        self._live[request_id] = req
        if req.retention.policy.compacts:
            req.retention.policy = RecordingPolicy(req.retention.policy, request_id,
                                                   self._evicted)
        self._writer.write({
            "type": "request", "id": request_id, "arrival_s": self._t(req.metrics.arrival_time),
            **self._writer.prompt_fields(req.prompt_token_ids),
            "max_tokens": req.params.max_tokens, "sampling": sampling_fields(req.params),
            "session": None, "salted": cache_salt is not None})

    def step(self) -> list:
        """``LLMEngine.step``; writes a ``step`` line and a ``finish`` line per finished one."""
        start = time.perf_counter()
        outputs = self._engine.step()
        duration = time.perf_counter() - start
        plan = self._engine.last_schedule
        if plan is not None and (plan.chunks or plan.preempted or plan.failed):
            self._writer.write({
                "type": "step", "index": self._steps, "start_s": self._t(start),
                "duration_s": round(duration, 6),
                "chunks": [[c.request.request_id, c.start, c.num_new_tokens]
                           for c in plan.chunks],
                "preempted": [r.request_id for r in plan.preempted],
                "failed": [r.request_id for r, _ in plan.failed],
                "evicted": [[rid, dropped_ranges(p)] for rid, p in self._evicted]})
            self._steps += 1
        self._evicted.clear()
        for out in outputs:
            if out.finished:
                self._finish(out.request_id, out.finish_reason, out)
        return outputs

    def abort(self, request_id: str) -> None:
        """``LLMEngine.abort``; writes a ``finish`` line with reason ``abort``."""
        self._engine.abort(request_id)
        if request_id in self._live:
            self._finish(request_id, "abort", self._live[request_id].output)

    def _finish(self, request_id: str, reason: str | None, out) -> None:
        req = self._live.pop(request_id, None)
        if req is None:
            return
        m = req.metrics
        line = {"type": "finish", "id": request_id, "time_s": self._t(time.perf_counter()),
                "reason": reason, "output_tokens": len(req.output_token_ids)}
        if not self._writer.private:
            line["output_token_ids"] = list(req.output_token_ids)
        done = m.finished_time
        line |= {"ttft_s": m.ttft_s, "tpot_s": out.tpot_s, "queue_s": m.queue_time_s,
                 "e2e_s": None if done is None else done - m.arrival_time,
                 "preemptions": req.num_preemptions, "peak_kv_blocks": req.peak_num_blocks}
        self._writer.write(line)
