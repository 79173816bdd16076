"""Evicting retention policies in replay: a live run under sinks or h2o, replayed with its step
durations, reproduces the live schedule, preemptions and per-request peak blocks exactly."""

from __future__ import annotations

import json

import pytest
import torch

from kvledger.engine.config import EngineConfig
from kvledger.engine.retention.policies import make_policy
from kvledger.ledger.retention import RetentionSpec
from kvledger.replay.retention import ReplayedPolicy, dropped_ranges, positions_of
from kvledger.replay.setup import live_retention
from kvledger.replay.simulator import RecordedClock, Simulator
from kvledger.replay.trace import read_trace

SINKS = {"kv_policy": "sinks", "kv_window": 8, "kv_sinks": 4, "kv_positions": "original",
         "num_blocks": 18}  # original: the live run that preempts was picked with them
H2O = {"kv_policy": "h2o", "kv_budget": 14, "kv_window": 4, "kv_sinks": 2, "num_blocks": 17,
       "kv_select": "per-sequence"}  # the recorded-evictions path; per-head replay: not here


def _replay(trace, engine, **options):
    config = EngineConfig(**(trace.header["engine"] | options))
    sim = Simulator(trace, config, trace.header["num_blocks"], engine.bytes_per_block,
                    engine.max_model_len, RecordedClock(trace.steps),
                    live_retention=live_retention(trace.header))
    return sim.run()


def _schedule(steps):
    return [(s["chunks"], s["preempted"]) for s in steps]


def _check_exact(trace, engine, run):
    assert _schedule(run.steps) == _schedule(trace.steps)
    assert run.preemptions == engine.scheduler.num_preemptions
    for sim in run.requests:
        assert sim.request.peak_num_blocks == sim.trace.finish["peak_kv_blocks"], sim.trace.id
        assert len(sim.request.output_token_ids) == sim.trace.finish["output_tokens"]


def _evicted_some(trace) -> bool:
    """Some request held fewer blocks at its peak than full retention needs for it."""
    block = trace.header["engine"]["block_size"]
    return any(r.finish["peak_kv_blocks"] < -(-(r.prompt_tokens + r.finish["output_tokens"] - 1)
                                              // block) for r in trace.requests)


@pytest.mark.parametrize("options", [SINKS, H2O], ids=["sinks", "h2o"])
def test_live_retention_run_replays_exactly(live_trace, options):
    path, engine = live_trace(**options)
    trace = read_trace(path)
    assert _evicted_some(trace), "the live run evicted nothing"
    assert engine.scheduler.num_preemptions >= 1, "no preemption in the live run"
    _check_exact(trace, engine, _replay(trace, engine))
    # negative control: the same trace replayed under full retention schedules otherwise
    full = _replay(trace, engine, kv_policy=None, kv_window=None, kv_sinks=None, kv_budget=None,
                   kv_select=None, kv_positions=None)
    assert _schedule(full.steps) != _schedule(trace.steps) or any(
        s.request.peak_num_blocks != s.trace.finish["peak_kv_blocks"] for s in full.requests)


def test_h2o_trace_records_the_engines_evictions(live_trace):
    path, _ = live_trace(**H2O)
    trace = read_trace(path)
    dropped = [runs for s in trace.steps for _, runs in s["evicted"]]
    assert dropped, "no eviction recorded"
    # a sequence over its budget keeps budget - 1 tokens: a decode step drops exactly one
    decodes = [(s, c) for s in trace.steps for c in s["chunks"] if c[2] == 1]
    one = [len(positions_of(runs)) for s, c in decodes for rid, runs in s["evicted"]
           if rid == c[0]]
    assert one and all(n == 1 for n in one)


def test_h2o_without_recorded_evictions_keeps_the_counts(live_trace, tmp_path):
    """Stand-in selection (no ``evicted`` in the trace): the policy's counts, so every request
    still finishes and its peak stays within one block of the live one, though the schedule
    parts from the live one (here at step 10, with 2 preemptions instead of 6: which tokens
    are kept decides when a block empties)."""
    path, engine = live_trace(**H2O)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for obj in lines:
        obj.pop("evicted", None)
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps(o) + "\n" for o in lines))
    trace = read_trace(bare)
    run = _replay(trace, engine)
    assert all(len(s.request.output_token_ids) == s.trace.finish["output_tokens"]
               for s in run.requests)
    assert all(abs(s.request.peak_num_blocks - s.trace.finish["peak_kv_blocks"]) <= 1
               for s in run.requests)


@pytest.mark.parametrize("spec", [RetentionSpec("h2o", budget=20, window=6, sinks=2),
                                  RetentionSpec("snapkv", budget=40)], ids=["h2o", "snapkv"])
def test_stand_in_keeps_the_policys_count(spec):
    """Whatever the scores, the policy keeps the same number of tokens; the stand-in keeps
    that number (the most recent candidates)."""
    policy = make_policy(spec)
    stand_in = ReplayedPolicy(policy)
    gen = torch.Generator().manual_seed(0)
    for n in (10, 19, 20, 45, 90):
        pos = torch.arange(n)
        scores = torch.rand(n, generator=gen)
        live = policy.keep(pos, scores, n, num_prompt_tokens=n - 5, compressed=False)
        ours = stand_in.keep(pos, torch.zeros(n), n, num_prompt_tokens=n - 5, compressed=False)
        assert int(ours.sum()) == int(live.sum())


def test_recorded_choice_is_kept_and_runs_round_trip():
    stand_in = ReplayedPolicy(make_policy(RetentionSpec("h2o", budget=8, window=2, sinks=1)))
    drops = [3, 4, 5, 9]
    assert dropped_ranges(drops) == [[3, 6], [9, 10]]
    stand_in.recorded = positions_of(dropped_ranges(drops))
    kept = stand_in.keep(torch.arange(12), torch.zeros(12), 12, 12, False)
    assert torch.arange(12)[~kept].tolist() == drops
