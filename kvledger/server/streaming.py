"""Delivering one request's outputs to its client: an SSE stream, or one collected body.

SSE framing follows the OpenAI API: each event is ``data: <json>\\n\\n``; the stream ends with
``data: [DONE]``; with ``stream_options.include_usage`` exactly one chunk with empty ``choices``
and the ``usage`` precedes ``[DONE]``. An error after the stream started is sent as one
``data: {"error": ...}`` event, then the stream closes.

Disconnects abort the request. Streaming: Starlette cancels the response task when the client
goes away (ASGI spec < 2.4, as uvicorn declares), which raises inside :func:`sse_events`; its
``finally`` aborts. Non-streaming: :func:`collect` checks ``request.is_disconnected()`` after
every output and every ``DISCONNECT_POLL_S`` without one. Either way the engine thread frees the request's KV blocks before its next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from kvledger.engine.outputs import RequestOutput, TokenLogprob
from kvledger.server.engine_loop import INTERNAL_ERROR
from kvledger.server.protocol import error_body
from kvledger.server.responses import step_logprobs

DISCONNECT_POLL_S = 0.1
DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before its non-streamed response was ready."""


class EngineFailure(Exception):
    """The engine finished the request with ``finish_reason == "error"``."""


def sse(payload: dict) -> str:
    """One SSE ``data:`` event."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def engine_error(out: RequestOutput) -> tuple[int, dict]:
    """HTTP status and OpenAI error object of a request the engine finished with an error.

    429 when the scheduler could not fit it (KV pool exhausted even after preemption); 500
    when a bug in the engine step failed it (:data:`INTERNAL_ERROR`) or the server stops.
    """
    message = out.error or "the engine could not serve this request"
    if message.startswith(INTERNAL_ERROR):
        return 500, error_body(message, "server_error", None, "internal_error")
    return 429, error_body(message, "rate_limit_error", None, "kv_pool_exhausted")


async def sse_events(outputs: asyncio.Queue, formatter, include_usage: bool,
                     abort: Callable[[], None]) -> AsyncIterator[str]:
    """SSE text of one request, one string per engine step (role + first token together)."""
    finished = False
    try:
        while not finished:
            out: RequestOutput = await outputs.get()
            finished = out.finished
            if out.finish_reason == "error":
                yield sse(engine_error(out)[1])
                return
            chunks = formatter.chunks(out)
            tail = []
            if finished:
                tail = [sse(formatter.usage_chunk(out))] if include_usage else []
                tail.append(DONE)
            if chunks or tail:
                yield "".join(sse(c) for c in chunks) + "".join(tail)
    finally:
        if not finished:
            abort()


async def collect(outputs: asyncio.Queue, request: Request,
                  abort: Callable[[], None]) -> tuple[RequestOutput, list[TokenLogprob]]:
    """Wait for the final output; return it with every token's logprobs.

    Raises:
        ClientGone: the client disconnected (the request is aborted).
        EngineFailure: the engine finished the request with an error.
    """
    logprobs: list[TokenLogprob] = []
    try:
        while True:
            try:
                out: RequestOutput | None = await asyncio.wait_for(outputs.get(),
                                                                   DISCONNECT_POLL_S)
            except TimeoutError:
                out = None
            if await request.is_disconnected():  # checked after every step, and when idle
                raise ClientGone()
            if out is None:
                continue
            logprobs.extend(step_logprobs(out))
            if out.finish_reason == "error":
                raise EngineFailure(out)
            if out.finished:
                return out, logprobs
    except (ClientGone, asyncio.CancelledError):
        abort()
        raise
