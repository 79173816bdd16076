"""API-key check (``--api-key``): every route needs the key except :data:`OPEN_PATHS`.

A pure ASGI middleware, installed outermost, so it answers before any byte of the body is
read: a request without the right ``Authorization: Bearer <key>`` gets 401 in the OpenAI error
shape whatever its body. Default deny: every ``/v1`` route, ``/tokenize`` and any route added
later needs the key; ``/health``, ``/metrics`` and the OpenAPI documents stay open, as in vLLM.
Keys are compared in constant time.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvledger.server.protocol import error_body

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc",
                        "/dashboard", "/dashboard/plan"})  # pages without data: they ask for it
OPEN_PREFIXES = ("/dashboard/assets/",)  # the dashboard's scripts, styles and licenses


def is_protected(path: str) -> bool:
    """True for the paths that need the key (all but :data:`OPEN_PATHS` and
    :data:`OPEN_PREFIXES`; the dashboard's data under ``/dashboard/api`` needs it)."""
    return path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES)


class ApiKeyMiddleware:
    """Reject protected requests lacking ``Authorization: Bearer <api_key>`` with 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_protected(scope["path"]):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # the auth scheme is case-insensitive (RFC 9110 §11.1)
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given, self._expected):
                body = error_body("invalid or missing API key (send 'Authorization: Bearer KEY')",
                                  "authentication_error", None, "invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
