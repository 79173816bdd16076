"""Request fields of the OpenAI APIs that this server does not implement: none is ignored.

Every field the OpenAI API reference (and the official ``openai`` client) lists for
``/v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` is one of:

- implemented: a field the request model declares (``protocol.py``, ``responses/protocol.py``);
- not implemented: in :data:`COMPLETIONS_UNSUPPORTED`, :data:`CHAT_UNSUPPORTED` or
  :data:`RESPONSES_UNSUPPORTED` with the test of its neutral value (what the API does when the
  field is omitted, which clients send), accepted; any other value is a 400 naming the field;
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

# Not implemented by /v1/completions (and vLLM's guided decoding, now its structured_outputs)
COMPLETIONS_UNSUPPORTED: dict[str, Neutral] = {
    "tools": _empty,
    "tool_choice": _is(None, "none", "auto"),  # "auto" without tools calls none
    "functions": _empty,  # deprecated by OpenAI for tools / tool_choice
    "function_call": _is(None, "none", "auto"),
    "parallel_tool_calls": _anything,  # meaningless without tools
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

# /v1/chat/completions implements tools, tool_choice and parallel_tool_calls besides
# response_format and structured_outputs (docs/structured-output.md)
CHAT_UNSUPPORTED: dict[str, Neutral] = {
    name: neutral for name, neutral in COMPLETIONS_UNSUPPORTED.items()
    if name not in ("tools", "tool_choice", "parallel_tool_calls")}


def _text_neutral(value: Any) -> bool:
    """``text`` (a parsed ``TextOptions``): its format is implemented, ``verbosity`` only at
    its default."""
    return getattr(value, "verbosity", None) in (None, "medium")


RESPONSES_UNSUPPORTED: dict[str, Neutral] = {
    **{name: COMPLETIONS_UNSUPPORTED[name] for name in (
        "moderation", "service_tier", "guided_json", "guided_regex", "guided_choice",
        "guided_grammar")},
    "response_format": lambda v: v is None or v == {"type": "text"},  # Chat's; here text.format
    "text": _text_neutral,
    "max_tool_calls": _anything,  # caps built-in tools' calls; none is served
    "reasoning": lambda v: _empty(v) or v == {"effort": None},
    "top_logprobs": _is(None, 0),
    "background": _is(None, False),
    "background_options": _empty,
    "conversation": _is(None),  # conversations continue with previous_response_id
    "prompt": _is(None),  # stored prompt templates
    "image": _empty,
    "access_programs": _empty,
    "context_management": _empty,
}

_GUIDED = "vLLM's guided_* fields are served as its structured_outputs object; send that"
REASONS = {
    "response_format": "on /v1/responses structured output is 'text.format'",
    "text": "text.verbosity other than 'medium' is not supported; omit it",
    "functions": "deprecated by OpenAI; send 'tools'",
    "function_call": "deprecated by OpenAI; send 'tool_choice'",
    **{f"guided_{kind}": _GUIDED for kind in ("json", "regex", "choice", "grammar")},
}

HINTS = frozenset({"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                   "prompt_cache_options", "metadata"})


def first_refused(given: dict[str, Any], unsupported: dict[str, Neutral]) -> str | None:
    """The first field of ``given`` in ``unsupported`` away from its neutral value, or None."""
    return next((name for name, neutral in unsupported.items()
                 if name in given and not neutral(given[name])), None)
