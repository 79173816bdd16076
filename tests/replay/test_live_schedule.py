"""A replay fed a live run's step durations reproduces that run's schedule exactly."""

from __future__ import annotations

from kvledger.engine.config import EngineConfig
from kvledger.replay.simulator import RecordedClock, Simulator
from kvledger.replay.trace import read_trace


def _replay(path, engine):
    trace = read_trace(path)
    config = EngineConfig(**trace.header["engine"])
    sim = Simulator(trace, config, trace.header["num_blocks"], engine.bytes_per_block,
                    engine.max_model_len, RecordedClock(trace.steps))
    return trace, sim.run()


def _schedule(steps):
    return [(s["chunks"], s["preempted"]) for s in steps]


def test_replay_reproduces_the_live_schedule(live_trace):
    path, engine = live_trace()
    trace, run = _replay(path, engine)
    live = _schedule(trace.steps)
    # the recorded run exercised what the replay must reproduce
    assert sum(len(p) for _, p in live) >= 1, "no preemption in the live run"
    assert any(n > 1 and start > 0 for chunks, _ in live for _, start, n in chunks), \
        "no chunked prefill continuation in the live run"
    assert engine.scheduler.kv.prefix.hit_tokens > 0, "no prefix-cache hit in the live run"
    assert _schedule(run.steps) == live
    assert run.preemptions == engine.scheduler.num_preemptions
    for sim in run.requests:
        assert len(sim.request.output_token_ids) == sim.trace.finish["output_tokens"]
        assert sim.request.num_preemptions == sim.trace.finish["preemptions"]
        assert sim.request.peak_num_blocks == sim.trace.finish["peak_kv_blocks"]


def test_the_comparison_sees_a_different_scheduler(live_trace):
    """Negative control: another token budget gives another schedule from the same trace."""
    path, engine = live_trace()
    trace = read_trace(path)
    config = EngineConfig(**(trace.header["engine"] | {"max_num_batched_tokens": 16}))
    sim = Simulator(trace, config, trace.header["num_blocks"], engine.bytes_per_block,
                    engine.max_model_len, RecordedClock(trace.steps))
    assert _schedule(sim.run().steps) != _schedule(trace.steps)


def test_private_trace_replays_the_same_schedule(live_trace):
    """Lengths + unsalted block hashes keep the sharing: the schedule is the token-id one."""
    path, engine = live_trace(private=True)
    trace, run = _replay(path, engine)
    assert all(r.prompt_token_ids is None and r.block_hashes is not None
               for r in trace.requests)
    assert _schedule(run.steps) == _schedule(trace.steps)


def test_replay_times_follow_the_recorded_clock(live_trace):
    """First token at the end of the step that sampled it: the engine's own stamp (taken inside
    that step, after sampling) lies within the replayed step, whatever the machine's load."""
    path, engine = live_trace(seed=1)
    trace, run = _replay(path, engine)
    for sim in run.requests:
        first = sim.token_times[0]
        step = min(trace.steps, key=lambda s: abs(s["start_s"] + s["duration_s"] - first))
        assert abs(step["start_s"] + step["duration_s"] - first) < 1e-5
        live = sim.trace.arrival_s + sim.trace.finish["ttft_s"]  # the stamp, trace clock
        assert step["start_s"] - 1e-5 <= live <= first + 1e-5


class _OneSecondSteps:
    """A clock whose steps run back to back and last 1 s each."""

    def start(self, index, now):
        return now

    def duration(self, index, plan):
        return 1.0


def test_arrival_is_stamped_when_the_engine_adds_the_request():
    """The engine stamps arrival in add_request, between steps: a request that comes in 0.5 s
    into a 1 s step is added at the next step's start (t = 1), computed in it, first token at
    t = 2: server-side TTFT 1 s (not 1.5 s), queue 0."""
    from kvledger.replay.trace import Trace, TraceRequest

    trace = Trace({}, [TraceRequest("a", 0.0, 8, [1] * 8, max_tokens=3),
                       TraceRequest("b", 0.5, 8, [2] * 8, max_tokens=2)])
    config = EngineConfig(block_size=4, num_blocks=32)
    run = Simulator(trace, config, 32, 1, 512, _OneSecondSteps()).run()
    a, b = run.requests
    assert (a.added_s, a.ttft_s, a.queue_s) == (0.0, 1.0, 0.0)
    assert (b.added_s, b.ttft_s, b.queue_s) == (1.0, 1.0, 0.0)
    assert b.token_times == [2.0, 3.0] and b.e2e_s == 2.0
