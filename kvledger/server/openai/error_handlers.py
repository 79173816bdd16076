"""Every error leaves the server in the OpenAI shape ``{"error": {message, type, param, code}}``.

- :class:`kvledger.errors.KVLedgerError` (the user's mistake) -> its ``http_status`` and
  ``code``: 400 invalid request / ``context_length_exceeded`` / ``kv_quota_exceeded`` (a request
  that can never fit) / ``unsupported_parameter``, 404 ``model_not_found``, 429 ``queue_full``
  / ``too_many_streams`` (load that will pass; 429s carry ``Retry-After``), 503
  ``engine_unavailable``;
- FastAPI's body validation (malformed JSON, missing or out-of-range fields), by default a 422,
  -> 400 with one sentence naming the field (:mod:`.validation`), the field in ``param``;
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
from kvledger.server.openai.errors import error_body
from kvledger.server.openai.protocol import UNION_RULES
from kvledger.server.openai.validation import describe

log = logging.getLogger("kvledger.server")

RETRY_AFTER_S = "1"
ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error"}
HTTP_REASONS = {404: "no such route", 405: "method not allowed on this route"}


def error_response(status: int, message: str, code: str | None = None,
                   param: str | None = None, headers: dict | None = None) -> JSONResponse:
    """An OpenAI-shaped error response; 429s and 503s get a ``Retry-After`` header."""
    err_type = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    headers = dict(headers or {})
    if status in (429, 503):
        headers.setdefault("Retry-After", RETRY_AFTER_S)
    return JSONResponse(error_body(message, err_type, param, code), status_code=status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    first = errors[0]
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return "The request body is empty; send a JSON object.", None
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "not valid JSON")
        return f"The request body is not valid JSON: {reason}.", None
    return describe(errors, UNION_RULES)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""

    @app.exception_handler(KVLedgerError)
    async def user_error(request: Request, exc: KVLedgerError) -> JSONResponse:
        return error_response(exc.http_status, str(exc), exc.code, getattr(exc, "param", None))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, None, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = HTTP_REASONS.get(exc.status_code, str(exc.detail))
        return error_response(exc.status_code, f"{detail}: {request.method} {request.url.path}"
                              if exc.status_code in HTTP_REASONS else detail, None,
                              headers=exc.headers)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, "internal server error", "internal_error")
