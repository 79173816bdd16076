"""Delivering a request's outputs to its client: an SSE stream, or one collected body.

One HTTP request may hold several engine requests (a list of prompts on ``/v1/completions``,
one choice each); their outputs share one ``asyncio.Queue`` and are told apart by request id.

SSE framing follows the OpenAI API: each event is ``data: <json>\\n\\n``; the stream ends with
``data: [DONE]``; with ``stream_options.include_usage`` exactly one chunk with empty ``choices``
and the summed ``usage`` precedes ``[DONE]``. An error after the stream started (an engine
failure, ``request_timeout_s`` passed) is sent as one ``data: {"error": ...}`` event, then the
stream closes.

Disconnects abort the request. Streaming: :class:`EngineStream` aborts in a ``finally`` around
the whole response, so an abort happens even when Starlette cancels the response before the
body generator started; a client that stops reading for ``send_timeout_s`` (a slow reader: the
server would otherwise hold its output) is dropped the same way. Non-streaming:
:func:`collect` checks ``request.is_disconnected()`` after every output and every
``DISCONNECT_POLL_S`` without one. Either way the engine thread frees the KV blocks before its
next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from kvledger.engine.output.request_output import RequestOutput, TokenLogprob
from kvledger.engine.sample.structured.masks import STRUCTURED_ERROR
from kvledger.server.engine_loop import INTERNAL_ERROR, SHUTDOWN_ERROR, UNAVAILABLE_ERROR
from kvledger.server.openai.errors import error_body
from kvledger.server.openai.formatters import step_logprobs

log = logging.getLogger("kvledger.server")

DISCONNECT_POLL_S = 0.1
DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before its non-streamed response was ready."""


class EngineFailure(Exception):
    """The engine finished the request with ``finish_reason == "error"``."""


class RequestTimedOut(Exception):
    """The request ran past ``request_timeout_s`` (it is aborted)."""


def timeout_error(timeout_s: float) -> dict:
    """The OpenAI error object of a request aborted at ``request_timeout_s``."""
    return error_body(f"the request did not finish within {timeout_s:g} s "
                      "(--request-timeout-s); it was aborted", "server_error", None,
                      "request_timeout")


def sse(payload: dict) -> str:
    """One SSE ``data:`` event."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def engine_error(out: RequestOutput) -> tuple[int, dict]:
    """HTTP status and OpenAI error object of a request the engine finished with an error.

    500 when a bug in the engine step failed it (:data:`INTERNAL_ERROR`); 503 when the server
    stopped the engine (:data:`SHUTDOWN_ERROR`, drain timeout) or the engine cannot compute
    (:data:`UNAVAILABLE_ERROR`: a tensor-parallel rank failed); 400 when the scheduler refused it for good (it outgrew what the KV pool can ever hold: a
    retry cannot pass, so not a 429), or its output could not satisfy its structured-output
    constraint (:data:`STRUCTURED_ERROR`, code ``structured_output_failed``).
    """
    message = out.error or "the engine could not serve this request"
    if message.startswith(INTERNAL_ERROR):
        return 500, error_body(message, "server_error", None, "internal_error")
    if message == SHUTDOWN_ERROR:
        return 503, error_body(message, "server_error", None, "server_draining")
    if message.startswith(UNAVAILABLE_ERROR):
        return 503, error_body(message, "server_error", None, "engine_unavailable")
    if message.startswith(STRUCTURED_ERROR):
        return 400, error_body(message, "invalid_request_error", None, "structured_output_failed")
    return 400, error_body(message, "invalid_request_error", None, "kv_quota_exceeded")


async def _next(outputs: asyncio.Queue, deadline: float | None) -> RequestOutput:
    if deadline is None:
        return await outputs.get()
    try:
        return await asyncio.wait_for(outputs.get(), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise RequestTimedOut() from None


async def sse_events(outputs: asyncio.Queue, formatters: dict, include_usage: bool,
                     abort: Callable[[], None], timeout_s: float | None = None
                     ) -> AsyncIterator[str]:
    """SSE text of one HTTP request, one string per engine output (role + first token together).

    Args:
        formatters: engine request id -> its choice's formatter (:mod:`.formatters`).
        abort: aborts every engine request of this HTTP request (idempotent).
        timeout_s: ``request_timeout_s`` (None = none).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    finals: dict[str, RequestOutput] = {}
    try:
        while len(finals) < len(formatters):
            try:
                out = await _next(outputs, deadline)
            except RequestTimedOut:
                yield sse(timeout_error(timeout_s))
                return
            if out.finish_reason == "error":  # finished by the engine; the others are aborted
                finals[out.request_id] = out
                yield sse(engine_error(out)[1])
                return
            formatter = formatters[out.request_id]
            chunks = formatter.chunks(out)
            tail = []
            if out.finished:
                finals[out.request_id] = out
                if len(finals) == len(formatters):
                    tail = ([sse(formatter.usage_chunk(list(finals.values())))]
                            if include_usage else [])
                    tail.append(DONE)
            if chunks or tail:
                yield "".join(sse(c) for c in chunks) + "".join(tail)
    finally:
        if len(finals) < len(formatters):  # some engine request still runs
            abort()


async def collect(outputs: asyncio.Queue, request: Request, abort: Callable[[], None],
                  n: int = 1, timeout_s: float | None = None
                  ) -> dict[str, tuple[RequestOutput, list[TokenLogprob]]]:
    """Wait for the final outputs of ``n`` engine requests; each with its tokens' logprobs.

    Returns:
        engine request id -> (final output, every token's logprobs).

    Raises:
        ClientGone: the client disconnected (the requests are aborted).
        EngineFailure: the engine finished a request with an error (the rest are aborted).
        RequestTimedOut: ``timeout_s`` passed (the requests are aborted).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    logprobs: dict[str, list[TokenLogprob]] = {}
    finals: dict[str, tuple[RequestOutput, list[TokenLogprob]]] = {}
    try:
        while len(finals) < n:
            if deadline is not None and time.monotonic() >= deadline:
                raise RequestTimedOut()
            try:
                out: RequestOutput | None = await asyncio.wait_for(outputs.get(),
                                                                   DISCONNECT_POLL_S)
            except TimeoutError:
                out = None
            if await request.is_disconnected():  # checked after every step, and when idle
                raise ClientGone()
            if out is None:
                continue
            lps = logprobs.setdefault(out.request_id, [])
            lps.extend(step_logprobs(out))
            if out.finish_reason == "error":
                raise EngineFailure(out)
            if out.finished:
                finals[out.request_id] = (out, lps)
        return finals
    except (ClientGone, EngineFailure, RequestTimedOut, asyncio.CancelledError):
        abort()
        raise


class EngineStream(StreamingResponse):
    """An SSE response that always releases its engine requests, and drops slow readers.

    Args:
        on_close: called once when the response ends, however it ends (aborts the engine
            requests still running, releases the stream slot).
        send_timeout_s: most seconds one write may wait for the client to read.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None],
                 send_timeout_s: float) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close
        self._send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self._send_timeout_s)
            except TimeoutError:
                log.warning("client stopped reading its stream for %g s; dropping it",
                            self._send_timeout_s)
                raise OSError("client stopped reading") from None

        try:
            await super().__call__(scope, receive, timed_send)
        except (OSError, ClientDisconnect):
            pass  # the slow reader is gone; nothing more can be sent
        finally:
            self._on_close()
