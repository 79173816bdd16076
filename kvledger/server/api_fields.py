"""Request fields of the OpenAI APIs that this server does not implement: none is ignored.

Every field the OpenAI API reference (and the official ``openai`` client) lists for
``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` is one of:

- implemented: a field the request model declares (``protocol.py``, ``responses_protocol.py``);
- not implemented: in :data:`CHAT_UNSUPPORTED` / :data:`RESPONSES_UNSUPPORTED` with the test of
  its neutral value (what the API does when the field is omitted, which clients send), accepted;
  any other value is a 400 naming the field;
- :data:`HINTS`: fields that do not change what one self-hosted server computes or returns
  (end-user ids for abuse monitoring, cache-routing keys and retention hints of a hosted
  fleet); accepted and, as the API allows, without effect.

``tests/server/test_api_fields.py`` checks the three lists against the ``openai`` client's
request types, so a field a new client version adds fails there until someone decides.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Neutral = Callable[[Any], bool]


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _is(*values: Any) -> Neutral:
    return lambda value: value in values


def _anything(value: Any) -> bool:  # meaningless while its companion field is refused
    return True


_SERVICE_TIER = _is(None, "auto", "default")  # one server has one tier

# /v1/completions and /v1/chat/completions (and vLLM's guided decoding)
CHAT_UNSUPPORTED: dict[str, Neutral] = {
    "response_format": lambda v: v is None or v == {"type": "text"},
    "tools": _empty,
    "tool_choice": _is(None, "none", "auto"),  # "auto" without tools calls none
    "functions": _empty,
    "function_call": _is(None, "none", "auto"),
    "parallel_tool_calls": _anything,
    "suffix": _is(None, ""),
    "best_of": _is(None, 1),
    "audio": _empty,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _empty,
    "reasoning_effort": _is(None),  # no reasoning model is served
    "verbosity": _is(None, "medium"),
    "web_search_options": _empty,
    "store": _is(None, False),  # stored chat completions (GET /v1/chat/completions/{id})
    "moderation": _empty,
    "service_tier": _SERVICE_TIER,
    "guided_json": _empty, "guided_regex": _empty, "guided_choice": _empty,
    "guided_grammar": _empty,
}


def _text_neutral(value: Any) -> bool:
    """``text``: plain-text output (structured output is not implemented yet)."""
    if value is None:
        return True
    return (isinstance(value, dict) and set(value) <= {"format", "verbosity"}
            and value.get("format") in (None, {"type": "text"})
            and value.get("verbosity") in (None, "medium"))


RESPONSES_UNSUPPORTED: dict[str, Neutral] = {
    **{name: CHAT_UNSUPPORTED[name] for name in (
        "response_format", "tools", "tool_choice", "parallel_tool_calls", "moderation",
        "service_tier", "guided_json", "guided_regex", "guided_choice", "guided_grammar")},
    "text": _text_neutral,
    "max_tool_calls": _anything,
    "reasoning": lambda v: _empty(v) or v == {"effort": None},
    "include": _empty,  # e.g. output logprobs
    "top_logprobs": _is(None, 0),
    "background": _is(None, False),
    "background_options": _empty,
    "conversation": _is(None),  # conversations continue with previous_response_id
    "prompt": _is(None),  # stored prompt templates
    "image": _empty,
    "access_programs": _empty,
    "context_management": _empty,
}

STRUCTURED = ("structured output ({} json_object / json_schema) is not supported yet; omit it or "
              "send {{'type': 'text'}}")
REASONS = {"response_format": STRUCTURED.format("response_format"),
           "text": STRUCTURED.format("text.format")}

HINTS = frozenset({"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                   "prompt_cache_options", "metadata"})


def first_refused(given: dict[str, Any], unsupported: dict[str, Neutral]) -> str | None:
    """The first field of ``given`` in ``unsupported`` away from its neutral value, or None."""
    return next((name for name, neutral in unsupported.items()
                 if name in given and not neutral(given[name])), None)
