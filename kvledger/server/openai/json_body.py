"""Every POST route takes a JSON body, whatever ``Content-Type`` the client sent.

``curl -d '{...}'`` sends ``application/x-www-form-urlencoded``, and other clients send
``text/plain`` or nothing; FastAPI would then validate the raw bytes and answer "must be an
object" for a perfectly good object. As vLLM does, the body is read as JSON anyway: this ASGI
middleware rewrites a POST's non-JSON ``Content-Type`` to ``application/json``, so a body that
is not JSON gets "The request body is not valid JSON" instead.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

JSON = b"application/json"


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";")[0].strip().lower()
    return media == JSON or media.endswith(b"+json")


class JsonBodyMiddleware:
    """Give POST requests without a JSON ``Content-Type`` an ``application/json`` one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = dict(scope["headers"]).get(b"content-type", b"")
            if not _is_json(given):
                scope = {**scope, "headers": [*headers, (b"content-type", JSON)]}
        await self.app(scope, receive, send)
