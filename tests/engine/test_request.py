"""One Request object per request: after finish, abort or failure no part of the engine still
holds the request, and "unfinished" has one definition (the scheduler's registry)."""

from __future__ import annotations

from collections import deque

from kvledger.engine.request import Request, RequestStatus
from kvledger.engine.sample.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _parts(engine) -> list:
    """Every object of the engine that could keep per-request state."""
    kv = engine.scheduler.kv
    return [engine, engine.scheduler, kv, kv.pool, kv.prefix, engine.sampler, engine.runner]


def _holders(engine, request_id: str) -> list[str]:
    """Attributes of the engine's parts whose container mentions ``request_id`` (as a key, or a
    Request with that id as a key, value or element)."""
    found = []
    for part in _parts(engine):
        for name, value in vars(part).items() if hasattr(part, "__dict__") else []:
            if isinstance(value, dict):
                items = list(value.keys()) + list(value.values())
            elif isinstance(value, list | deque | set | tuple):
                items = list(value)
            else:
                continue
            if any(x == request_id or (isinstance(x, Request) and x.request_id == request_id)
                   for x in items):
                found.append(f"{type(part).__name__}.{name}")
    return found


def _drain(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def test_the_walker_sees_a_live_request(tiny_engine_factory):
    """The check below can fail: a live request is found in the scheduler's registry and queue."""
    engine = tiny_engine_factory()
    engine.add_request("live", [5, 6, 7], GREEDY)
    assert set(_holders(engine, "live")) == {"Scheduler.waiting", "Scheduler.requests"}
    engine.step()
    assert set(_holders(engine, "live")) == {"Scheduler.running", "Scheduler.requests"}


def test_no_part_holds_a_request_after_finish_abort_or_failure(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=6, max_num_batched_tokens=16)
    seeded = SamplingParams(max_tokens=3, temperature=1.0, seed=3)
    engine.add_request("done", [5] * 20, seeded)
    engine.add_request("aborted-running", list(range(3, 60)), GREEDY)  # chunked prefill
    engine.add_request("aborted-waiting", [9] * 10, GREEDY)
    engine.step()
    engine.abort("aborted-running")
    engine.abort("aborted-waiting")
    engine.add_request("failed", [7] * 10, GREEDY)
    engine.scheduler.requests["failed"].max_tokens_effective = 10_000  # outgrows the pool
    finished = _drain(engine)
    assert finished["done"].finish_reason == "length"
    assert finished["failed"].finish_reason == "error"
    for rid in ("done", "aborted-running", "aborted-waiting", "failed"):
        assert _holders(engine, rid) == [], rid
    assert engine.scheduler.requests == {} and not engine.has_unfinished_requests()
    s = engine.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


def test_one_definition_of_unfinished(tiny_engine_factory):
    engine = tiny_engine_factory()
    engine.add_request("a", [5, 6, 7], GREEDY)
    req = engine.scheduler.requests["a"]
    states = []
    while engine.has_unfinished_requests():
        states.append((req.status, engine.scheduler.has_unfinished_requests()))
        engine.step()
    assert states[0] == (RequestStatus.WAITING, True)
    assert all(flag for _, flag in states)
    assert req.is_finished and not engine.scheduler.has_unfinished_requests()


def test_a_request_owns_its_sampling_state(tiny_engine_factory):
    """Two seeded requests with the same seed draw the same tokens in one batch: each has its
    own generator (kept on the Request, none in the sampler)."""
    engine = tiny_engine_factory()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request("x", [5, 6, 7], params)
    engine.add_request("y", [5, 6, 7], params)
    out = _drain(engine)
    assert out["x"].token_ids == out["y"].token_ids
