"""Request-body size cap: a larger body is answered 413 in the OpenAI error shape.

A pure ASGI middleware that reads the whole body before the app sees it (so the cap holds for
chunked uploads too) and then replays it; later ``receive()`` calls go to the server, so
disconnect detection still works. An oversized body is drained, not left unread, so the client
gets the 413 instead of a reset connection; a declared ``Content-Length`` over
``hard_limit_bytes`` is refused at once without draining.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvledger.server.protocol import error_body


class BodyLimitMiddleware:
    """Cap request bodies at ``max_bytes``; over it, answer 413."""

    def __init__(self, app: ASGIApp, max_bytes: int, hard_limit_bytes: int = 256 << 20) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.hard_limit_bytes = hard_limit_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.hard_limit_bytes:
            await self._reject(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # client gone before its body arrived
            body = message.get("body", b"")
            size += len(body)
            if size <= self.max_bytes:
                chunks.append(body)
            if not message.get("more_body", False):
                break
        if size > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = error_body(f"request body too large (limit {self.max_bytes} bytes)",
                          "invalid_request_error", None, "request_too_large")
        await JSONResponse(body, status_code=413)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
