"""Size limits on a request's input, checked on the parsed JSON before validation or tokenizing.

A body within ``max_body_bytes`` can still hold 100,000 chat messages or a 3 MB instruction,
and validating or tokenizing that costs seconds of CPU. So every request body is measured
first, in one pass over its input fields (:data:`INPUT_FIELDS`): the characters of their
strings (``max_input_chars``) and the items of their lists: messages, content parts, prompts,
input items (``max_input_items``). Token ids are not items (a token-id prompt is bounded by
the context), and documents' ``file_data`` are not characters (``max_document_bytes`` bounds
them). Over a limit: HTTP 400 ``input_too_large`` naming the field. Once tokenized, a request
whose ``prompt_logprobs`` answer would hold more than ``max_prompt_logprob_entries`` entries
(over all its prompts) is refused the same way, naming ``prompt_logprobs`` (:func:`check_prompt_logprobs`).

The limits are the app's :class:`~kvledger.server.limits.server_limits.ServerLimits`, which the
routers' dependency :func:`bind_input_limits` makes current for the request before FastAPI validates
its body (dependencies are solved before the body).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from starlette.requests import Request

from kvledger.errors import InvalidParameterError
from kvledger.server.limits.server_limits import ServerLimits

INPUT_FIELDS = ("prompt", "messages", "input", "instructions")
NOT_COUNTED = frozenset({"file_data"})  # bounded by max_document_bytes
DEFAULT_LIMITS = ServerLimits()
_LIMITS: ContextVar[ServerLimits | None] = ContextVar("kvledger_input_limits", default=None)


class InputTooLargeError(InvalidParameterError):
    """A request's input has more characters or items than the server takes (HTTP 400)."""

    code = "input_too_large"

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


async def bind_input_limits(request: Request) -> None:
    """FastAPI dependency: the app's limits apply to this request's body."""
    _LIMITS.set(request.app.state.server.limits)


def _measure(value: Any, field: str, counts: list[int], limits: ServerLimits) -> None:
    """Add ``value``'s characters and items to ``counts``; raise once one is over its limit."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            counts[0] += len(item)
        elif isinstance(item, list) and not (item and isinstance(item[0], int)):
            counts[1] += len(item)  # a list of token ids is not counted
            if counts[1] <= limits.max_input_items:
                stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(v for k, v in item.items() if k not in NOT_COUNTED)
        if counts[1] > limits.max_input_items:
            raise InputTooLargeError(field, f"'{field}' holds over {limits.max_input_items} "
                                     "items (messages, content parts, prompts); this server takes "
                                     "at most that many (--max-input-items)")
    if counts[0] > limits.max_input_chars:
        raise InputTooLargeError(field, f"the input has {counts[0]:,} characters ('{field}' "
                                 f"passes the limit); this server takes at most "
                                 f"{limits.max_input_chars:,} (--max-input-chars)")


def check_input_size(data: Any) -> None:
    """Refuse a raw JSON body whose input fields are over the current limits.

    Raises:
        InputTooLargeError: naming the field that crossed a limit (HTTP 400).
    """
    if not isinstance(data, dict):
        return  # validation says what is wrong
    limits, counts = _LIMITS.get() or DEFAULT_LIMITS, [0, 0]
    for field in INPUT_FIELDS:
        if field in data:
            _measure(data[field], field, counts, limits)


def check_prompt_logprobs(limits: ServerLimits, prompts: list[list[int]], k: int | None) -> None:
    """Refuse prompt logprobs (top ``k``; None: not asked) of one request's ``prompts`` (token
    ids) whose entries, their tokens x (k + 1), pass ``max_prompt_logprob_entries``.

    Raises:
        InputTooLargeError: naming ``prompt_logprobs`` (HTTP 400).
    """
    if k is None:
        return
    entries = sum(map(len, prompts)) * (k + 1)
    cap = limits.max_prompt_logprob_entries
    if entries > cap:
        raise InputTooLargeError("prompt_logprobs", (
            f"prompt logprobs of this request would hold {entries:,} entries (its prompts' "
            f"tokens x (prompt_logprobs + 1), 'echo' with 'logprobs' N counting N); this "
            f"server takes at most {cap:,} (--max-prompt-logprob-entries)"))
