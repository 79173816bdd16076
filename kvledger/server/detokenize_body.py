"""A ``/detokenize`` body parsed a slice of its ids at a time, so the GIL is given up between
slices.

pydantic's JSON validation holds the GIL for a whole call: 1.5 M ids kept the event loop (and
``/health``) waiting for 0.1-0.6 s though the call ran in the tokenizer thread. When the body is
an object whose last member is ``"tokens": [numbers]`` (what clients send), the rest of the body
is validated with the ids left out, and the ids ``SLICE_BYTES`` of text at a time with the same
rules (strict integers >= 0, not empty); errors name ``tokens[i]`` as a whole-body validation
would. Any other shape, and any slice that is not JSON, goes through the whole-body validation.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ConfigDict, TypeAdapter, ValidationError

from kvledger.server.openai.protocol import DetokenizeRequest, TokenIds

SLICE_BYTES = 1 << 18  # ~50,000 ids: a few milliseconds of the GIL each
_NUMBER_TEXT = b"0123456789,-+.eE \t\r\n"  # all an array of JSON numbers holds
_KEY = re.compile(rb'[{,\s]"tokens"\s*:\s*\Z')
_IDS = TypeAdapter(TokenIds, config=ConfigDict(strict=True))


def parse_detokenize_body(raw: bytes) -> DetokenizeRequest:
    """``raw`` as a DetokenizeRequest.

    Raises:
        RequestValidationError: as FastAPI's for the body (a missing body, bad JSON, a field
            naming its place).
    """
    split = _split_ids(raw)
    if split is None:
        return _validated(raw)
    head, text = split
    try:
        body, errors = _validated(head), []
    except RequestValidationError as exc:
        body, errors = None, list(exc.errors())
    ids = _slices(text, errors)
    if ids is None:
        return _validated(raw)
    if errors:
        raise RequestValidationError(errors)
    return body.model_copy(update={"tokens": ids})


def _split_ids(raw: bytes) -> tuple[bytes, bytes] | None:
    """(``raw`` with its ids replaced by ``[0]``, the ids' text) when the body ends with a
    ``"tokens"`` member holding numbers only, else None."""
    end = len(raw.rstrip())
    if not end or raw[end - 1:end] != b"}":
        return None
    close = len(raw[:end - 1].rstrip()) - 1
    if close < 0 or raw[close:close + 1] != b"]":
        return None
    start = raw.rfind(b"[", 0, close)
    if start < 0 or raw[start + 1:close].translate(None, _NUMBER_TEXT):
        return None
    if not _KEY.search(raw[max(0, start - 64):start]):
        return None
    return raw[:start] + b"[0]" + raw[close + 1:], raw[start + 1:close]


def _slices(text: bytes, errors: list) -> list[int] | None:
    """The ids of ``text`` (an array's inside), validated a slice at a time, their errors
    appended to ``errors``; None when a slice is not JSON (the caller validates the whole body
    for the exact message)."""
    ids: list[int] = []
    pos = count = 0
    while True:
        cut = text.find(b",", pos + SLICE_BYTES)
        cut = len(text) if cut < 0 else cut
        piece = text[pos:cut]
        try:
            ids += _IDS.validate_json(b"[" + piece + b"]")
        except ValidationError as exc:
            found = exc.errors(include_url=False)
            if any(e["type"] == "json_invalid" for e in found):
                return None
            errors += [_at(e, count) for e in found]
        count += piece.count(b",") + 1 if piece.strip() else 0
        if cut >= len(text):
            return ids
        pos = cut + 1


def _at(error: dict[str, Any], offset: int) -> dict[str, Any]:
    """A slice's error located in the body (``tokens[offset + i]``)."""
    loc = error["loc"]
    where = (offset + loc[0], *loc[1:]) if loc and isinstance(loc[0], int) else loc
    return {**error, "loc": ("body", "tokens", *where)}


def _validated(raw: bytes) -> DetokenizeRequest:
    """``raw`` as a DetokenizeRequest by one pydantic call, or the RequestValidationError
    FastAPI would raise."""
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    try:
        return DetokenizeRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                      for e in exc.errors(include_url=False)]) from None
