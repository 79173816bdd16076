"""The OpenAI error shape, ``{"error": {"message", "type", "param", "code"}}``, in which every
error leaves the server (:mod:`.error_handlers`), and the error of a request field this server
does not implement.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from kvledger.errors import InvalidParameterError


class UnsupportedParameterError(InvalidParameterError):
    """A request field of the OpenAI API that this server does not implement (HTTP 400)."""

    code = "unsupported_parameter"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, err_type: str, param: str | None = None, code: Any = None) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    """The inside of an OpenAI error."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAPI schema of every 4xx answer (see :func:`error_body`)."""

    error: ErrorDetail
