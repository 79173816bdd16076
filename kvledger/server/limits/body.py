"""Request-body limits: size (413), arrival time (408) and JSON nesting (400), in the OpenAI
error shape.

A pure ASGI middleware that reads the whole body before the app sees it (so the cap holds for
chunked uploads too) and then replays it; later ``receive()`` calls go to the server, so
disconnect detection still works.

- A body over ``max_bytes`` (declared or counted) is answered 413 with ``Connection: close``.
  Before answering, the middleware drains at most ``max_bytes`` more bytes for at most
  ``drain_s`` seconds, so that a client still sending a modest overshoot reads the 413 instead
  of a reset connection; a client streaming forever is cut off at either bound.
- A body that has not fully arrived ``timeout_s`` after the headers (a half-sent body, a
  client trickling bytes) is answered 408 with ``Connection: close``.
- A body whose arrays and objects nest deeper than ``max_depth`` (default
  :data:`MAX_JSON_DEPTH`) is answered 400 naming the limit, before any parser recurses into it
  (Python's ``json`` gives up near its recursion limit, ~1,000 levels, with a generic error;
  a structured-output schema is walked recursively after it). Brackets inside JSON strings do
  not count; a body with no more opening brackets than the limit is not scanned.
- An integer literal of more digits than Python converts (``sys.get_int_max_str_digits()``,
  4,300; its JSON parser fails on it with a generic error) is answered 400
  ``number_too_long`` naming the top-level field that holds it. A body without such a run of
  digits is not parsed here.

Install it inside the API-key check, so an unauthenticated client is refused (401) before any
byte of its body is read.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvledger.server.openai.errors import error_body

CLOSE = {"Connection": "close"}
MAX_JSON_DEPTH = 128  # a structured-output schema nests 2 levels per level of its own
_STEPS = bytes.maketrans(b'[{]}"', b"\x01\x01\xff\xff\x02")  # +1, -1 (int8), a quote
_OTHERS = bytes(c for c in range(256) if c not in b'[]{}"')


_INT_DIGITS = sys.get_int_max_str_digits()  # 0: no limit
_DIGIT_MARKS = bytes(1 if chr(c).isdigit() and c < 128 else 0 for c in range(256))
_LONG_RUN = b"\x01" * (_INT_DIGITS + 1) if _INT_DIGITS else None  # a run of that many digits


class _BodyTimeout(Exception):
    pass


class _TooLong:
    """What an over-long integer literal parses to here."""


class BodyLimitMiddleware:
    """Cap request bodies at ``max_bytes`` (413) and their arrival at ``timeout_s`` (408).

    Args:
        max_bytes: largest accepted body (bytes).
        timeout_s: most seconds from the start of the request to its body's last byte.
        drain_s: most seconds spent draining an over-limit body before the 413.
        max_depth: deepest nesting of JSON arrays and objects accepted.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0,
                 drain_s: float = 2.0, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.drain_s = drain_s
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.timeout_s
        declared = dict(scope["headers"]).get(b"content-length", b"")
        try:
            if declared.isdigit() and int(declared) > self.max_bytes:
                await self._drain(receive, 0, deadline)
                await self._too_large(scope, receive, send)
                return
            chunks, size, more = [], 0, True
            while more and size <= self.max_bytes:
                message = await _receive_by(receive, deadline)
                if message["type"] != "http.request":
                    return  # client gone before its body arrived
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
            if size > self.max_bytes:
                if more:
                    await self._drain(receive, size - self.max_bytes, deadline)
                await self._too_large(scope, receive, send)
                return
        except _BodyTimeout:
            body = error_body(f"the request body did not arrive within {self.timeout_s:g} s",
                              "invalid_request_error", None, "request_timeout")
            await JSONResponse(body, status_code=408, headers=CLOSE)(scope, receive, send)
            return
        body = b"".join(chunks)
        if body.count(b"[") + body.count(b"{") > self.max_depth:
            depth = json_depth(body)
            if depth > self.max_depth:
                message = (f"the request body's JSON nests arrays and objects {depth} levels "
                           f"deep; the limit is {self.max_depth} levels")
                error = error_body(message, "invalid_request_error", None, "json_too_deep")
                await JSONResponse(error, status_code=400)(scope, receive, send)
                return
        field = too_long_integer(body)
        if field is not None:
            message = (f"{f'{field!r}' if field else 'the body'} holds an integer of more "
                       f"than {_INT_DIGITS} digits")
            error = error_body(message, "invalid_request_error", field or None,
                               "number_too_long")
            await JSONResponse(error, status_code=400)(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _drain(self, receive: Receive, over: int, deadline: float) -> None:
        """Read and drop the rest of the body, up to ``max_bytes`` more and ``drain_s``."""
        deadline = min(deadline, time.monotonic() + self.drain_s)
        try:
            while over <= self.max_bytes:
                message = await _receive_by(receive, deadline)
                over += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
        except _BodyTimeout:
            return

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = error_body(f"request body too large (limit {self.max_bytes} bytes)",
                          "invalid_request_error", None, "request_too_large")
        await JSONResponse(body, status_code=413, headers=CLOSE)(scope, receive, send)


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``body``: the running count
    of opening minus closing brackets outside strings, at its highest. C loops only: escaped
    backslashes and quotes dropped, every byte but brackets and quotes dropped, then a bracket
    after an odd number of quotes is inside a string."""
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = np.frombuffer(text.translate(_STEPS, _OTHERS), np.int8)
    quote = marks == 2
    inside = (np.cumsum(quote, dtype=np.int32) & 1).astype(bool)
    steps = np.where(quote | inside, 0, marks)
    return int(np.cumsum(steps, dtype=np.int32).max()) if steps.size else 0


def too_long_integer(body: bytes) -> str | None:
    """The top-level field of the JSON ``body`` holding an integer literal of more digits than
    Python converts ("" when it is the body itself), None when there is none (or the body is
    no JSON: the app says so)."""
    if _LONG_RUN is None or _LONG_RUN not in body.translate(_DIGIT_MARKS):  # C loops: 10 MB
        return None  # in ~20 ms (a regex took 0.7 s)

    def parse_int(text: str):
        return _TooLong if len(text.lstrip("-")) > _INT_DIGITS else int(text)

    try:
        data = json.loads(body, parse_int=parse_int)
    except (ValueError, RecursionError):
        return None
    if data is _TooLong:
        return ""
    if isinstance(data, dict):
        return next((key for key, value in data.items() if _holds(value)), None)
    return "" if _holds(data) else None


def _holds(value) -> bool:
    if value is _TooLong:
        return True
    if isinstance(value, dict):
        value = value.values()
    return isinstance(value, list | type({}.values())) and any(_holds(v) for v in value)


async def _receive_by(receive: Receive, deadline: float) -> Message:
    try:
        return await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise _BodyTimeout() from None


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
