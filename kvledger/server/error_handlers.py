"""Every error leaves the server in the OpenAI shape ``{"error": {message, type, param, code}}``.

- :class:`kvledger.errors.KVLedgerError` (the user's mistake) -> its ``http_status`` and
  ``code``: 400 invalid request / ``context_length_exceeded``, 404 ``model_not_found``, 429
  ``kv_quota_exceeded`` / ``queue_full`` (429s carry ``Retry-After``);
- FastAPI's body validation (malformed JSON, missing or out-of-range fields), by default a 422,
  -> 400 naming the offending field in ``param``;
- Starlette's HTTP errors (unknown route 404, wrong method 405) keep their status;
- anything else is a bug: 500 ``server_error`` with a generic message (logged with traceback).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from kvledger.errors import KVLedgerError
from kvledger.server.protocol import error_body

log = logging.getLogger("kvledger.server")

RETRY_AFTER_S = "1"
ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error"}


def error_response(status: int, message: str, code: str | None = None,
                   param: str | None = None) -> JSONResponse:
    """An OpenAI-shaped error response; 429s get a ``Retry-After`` header."""
    err_type = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    headers = {"Retry-After": RETRY_AFTER_S} if status == 429 else None
    return JSONResponse(error_body(message, err_type, param, code), status_code=status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "not valid JSON")
        return f"malformed JSON body: {reason}", None
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid')}")
    first_loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    return "invalid request body: " + "; ".join(parts), (first_loc[0] if first_loc else None)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""

    @app.exception_handler(KVLedgerError)
    async def user_error(request: Request, exc: KVLedgerError) -> JSONResponse:
        return error_response(exc.http_status, str(exc), exc.code)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, None, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal server error", "internal_error")
