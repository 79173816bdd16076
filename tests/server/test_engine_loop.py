"""The engine thread: one owner thread, shared steps, aborts before the next step, snapshots."""

import asyncio

import pytest
from fake_engine import FakeEngine

from kvledger.engine.output.request_output import RequestOutput, TokenLogprob
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import ContextLengthError
from kvledger.server.engine_loop import EngineLoop, snapshot
from kvledger.server.metrics.observer import RequestObserver
from kvledger.server.metrics.server_metrics import ServerMetrics


async def _with_loop(engine: FakeEngine, body):
    loop = EngineLoop(engine, RequestObserver(ServerMetrics("fake-model")))
    loop.start()
    try:
        return await body(loop)
    finally:
        loop.stop()


async def _drain(queue: asyncio.Queue) -> list[RequestOutput]:
    outs = [await queue.get()]
    while not outs[-1].finished:
        outs.append(await queue.get())
    return outs


def test_concurrent_requests_share_engine_steps():
    engine = FakeEngine(step_delay_s=0.005)

    async def body(loop):
        params = SamplingParams(max_tokens=6, temperature=0)
        qa = await loop.add("a", "x", params)
        qb = await loop.add("b", "y", params)
        return await asyncio.gather(_drain(qa), _drain(qb))

    outs_a, outs_b = asyncio.run(_with_loop(engine, body))
    assert len(outs_a) == len(outs_b) == 6
    # b got its first token while a was still generating: they shared steps
    assert outs_b[0].metrics.first_token_time < outs_a[-1].metrics.last_token_time


def test_add_errors_reach_the_caller_and_abort_frees_before_the_next_step():
    engine = FakeEngine(step_delay_s=0.01)

    async def body(loop):
        with pytest.raises(ContextLengthError):
            await loop.add("big", "x" * 1000, SamplingParams(max_tokens=1))
        await loop.add("r", "x", SamplingParams(max_tokens=200))
        loop.abort("r")
        return await loop.call(lambda e: (list(e.requests), list(e.aborted)))

    running, aborted = asyncio.run(_with_loop(engine, body))
    assert running == [] and aborted == ["r"]


def test_outputs_are_snapshots_the_engine_cannot_mutate():
    out = RequestOutput("r", [1], token_ids=[5], new_token_ids=[5], new_text="a",
                        logprobs=[TokenLogprob(5, -1.0)])
    copy = snapshot(out)
    out.new_text, out.metrics.peak_kv_bytes = "b", 99
    out.logprobs.append(TokenLogprob(6, -2.0))
    assert (copy.new_text, copy.metrics.peak_kv_bytes, len(copy.logprobs)) == ("a", 0, 1)
