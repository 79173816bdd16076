"""SSE framing, the role-with-first-token rule, usage chunk, errors and disconnect aborts."""

import asyncio
import json

import pytest
from fake_engine import FakeTokenizer

from kvledger.engine.output.request_output import RequestOutput, TokenLogprob
from kvledger.server.openai.formatters import ChatFormatter, CompletionFormatter, step_logprobs
from kvledger.server.openai.streaming import ClientGone, EngineFailure, collect, sse_events


def _out(tokens: str, new: str, finished: str | None = None, lps=None) -> RequestOutput:
    return RequestOutput(
        request_id="r", prompt_token_ids=[1, 2, 3], token_ids=[ord(c) for c in tokens],
        text=tokens, new_token_ids=[ord(c) for c in new], new_text=new,
        finished=finished is not None, finish_reason=finished, logprobs=lps,
    )


def _events(text: str) -> list:
    """Parse an SSE string into its data payloads (JSON objects, or the string '[DONE]')."""
    payloads = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: ")
            data = block[len("data: "):]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


async def _run_stream(outputs: list[RequestOutput], formatter, include_usage: bool):
    queue: asyncio.Queue = asyncio.Queue()
    for out in outputs:
        queue.put_nowait(out)
    aborted = []
    writes = [w async for w in sse_events(queue, {"r": formatter}, include_usage,
                                          lambda: aborted.append(True))]
    return writes, aborted


def _chat() -> ChatFormatter:
    return ChatFormatter("chatcmpl-1", "m", FakeTokenizer(), logprobs=False)


def test_role_chunk_goes_out_with_the_first_content_never_before():
    outputs = [_out("", ""), _out("H", "H"), _out("Hi", "i", "stop")]
    writes, aborted = asyncio.run(_run_stream(outputs, _chat(), include_usage=False))
    first = _events(writes[0])  # the empty step wrote nothing; the first write has both
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first[1]["choices"][0]["delta"] == {"content": "H"}
    last = _events(writes[-1])
    assert last[0]["choices"][0]["finish_reason"] == "stop" and last[-1] == "[DONE]"
    assert not aborted


def test_include_usage_gives_exactly_one_usage_chunk_before_done():
    outputs = [_out("H", "H"), _out("Hi", "i", "length")]
    writes, _ = asyncio.run(_run_stream(outputs, _chat(), include_usage=True))
    events = _events("".join(writes))
    usage = [e for e in events if isinstance(e, dict) and e.get("usage")]
    assert len(usage) == 1 and usage[0]["choices"] == []
    assert usage[0]["usage"]["completion_tokens"] == 2 and usage[0]["usage"]["prompt_tokens"] == 3
    assert events[-2] is usage[0] and events[-1] == "[DONE]"


def test_engine_error_mid_stream_is_one_error_event_then_close():
    failed = RequestOutput(request_id="r", prompt_token_ids=[1], finished=True,
                           finish_reason="error", error="pool exhausted")
    writes, aborted = asyncio.run(_run_stream([_out("H", "H"), failed], _chat(), True))
    events = _events("".join(writes))
    assert events[-1]["error"]["message"] == "pool exhausted"
    assert "[DONE]" not in events and not aborted


def test_cancelled_stream_aborts_its_request():
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(_out("H", "H"))
        aborted = []
        gen = sse_events(queue, {"r": _chat()}, False, lambda: aborted.append(True))
        await gen.__anext__()
        await gen.aclose()  # what Starlette does when the client disconnects
        return aborted

    assert asyncio.run(scenario()) == [True]


class _Request:
    def __init__(self, disconnected: bool):
        self.disconnected = disconnected

    async def is_disconnected(self) -> bool:
        return self.disconnected


def test_collect_aborts_when_the_client_leaves():
    async def scenario():
        aborted = []
        with pytest.raises(ClientGone):
            await collect(asyncio.Queue(), _Request(True), lambda: aborted.append(True))
        return aborted

    assert asyncio.run(scenario()) == [True]


def test_collect_returns_final_output_and_all_logprobs():
    lps = [TokenLogprob(ord("H"), -0.1), TokenLogprob(ord("i"), -0.2)]

    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(_out("H", "H", lps=lps[:1]))
        queue.put_nowait(_out("Hi", "i", "stop", lps=lps))  # cumulative, as the engine keeps it
        return await collect(queue, _Request(False), lambda: None)

    (final, got), = asyncio.run(scenario()).values()
    assert final.text == "Hi" and got == lps


def test_collect_raises_on_engine_error():
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait(RequestOutput("r", [1], finished=True, finish_reason="error", error="x"))
        await collect(queue, _Request(False), lambda: None)

    with pytest.raises(EngineFailure):
        asyncio.run(scenario())


def test_step_logprobs_takes_this_steps_tokens_from_either_layout():
    lps = [TokenLogprob(1, -1.0), TokenLogprob(2, -2.0)]
    out = _out("ab", "b", lps=lps)  # cumulative list
    assert step_logprobs(out) == lps[1:]
    out.logprobs = lps[1:]  # per-step list
    assert step_logprobs(out) == lps[1:]


def test_completion_logprobs_have_the_legacy_shape():
    fmt = CompletionFormatter("cmpl-1", "m", FakeTokenizer(), logprobs=True)
    lps = [TokenLogprob(ord("a"), -1.0, [(ord("a"), -1.0)]),
           TokenLogprob(ord("b"), float("-inf"), [(ord("b"), float("-inf"))])]
    body = fmt.response(_out("ab", "b", "stop", lps), lps)
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"], "token_logprobs": [-1.0, -9999.0],
        "top_logprobs": [{"a": -1.0}, {"b": -9999.0}], "text_offset": [0, 1]}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}
