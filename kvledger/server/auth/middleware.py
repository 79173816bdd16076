"""API-key check (``--api-key``): every route needs the key except :data:`OPEN_PATHS`.

A pure ASGI middleware, installed outermost, so it answers before any byte of the body is
read: a request without the right ``Authorization: Bearer <key>`` gets 401 in the OpenAI error
shape whatever its body. Default deny: every ``/v1`` route, ``/tokenize`` and any route added
later needs the key; ``/health``, ``/metrics`` and the OpenAPI documents stay open, as in vLLM.
Several keys may be accepted (one per tenant of the Responses API); each is compared in
constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvledger.server.openai.errors import error_body

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc",
                        "/dashboard", "/dashboard/plan"})  # pages without data: they ask for it
OPEN_PREFIXES = ("/dashboard/assets/",)  # the dashboard's scripts, styles and licenses


def is_protected(path: str) -> bool:
    """True for the paths that need the key (all but :data:`OPEN_PATHS` and
    :data:`OPEN_PREFIXES`; the dashboard's data under ``/dashboard/api`` needs it)."""
    return path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES)


class ApiKeyMiddleware:
    """Reject protected requests lacking ``Authorization: Bearer <one of api_key>`` with 401."""

    def __init__(self, app: ASGIApp, api_key: str | Sequence[str]) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        self._expected = [key.encode() for key in keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and is_protected(scope["path"]):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # the auth scheme is case-insensitive (RFC 9110 §11.1)
            matches = [hmac.compare_digest(given, key) for key in self._expected]
            if scheme.lower() != b"bearer" or not any(matches):
                body = error_body("invalid or missing API key (send 'Authorization: Bearer KEY')",
                                  "authentication_error", None, "invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
