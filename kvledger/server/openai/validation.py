"""Pydantic validation errors as one readable sentence that names the field.

Pydantic locates an error in a union by the branch's internal type name (``prompt.function-
after[functools.partial(<function min_length_validator at 0x…>`` ...); this module drops those
tags, keeps the field path (``messages[0].role``), words each error type as a short phrase and
joins the branches of one field with "or": ``'prompt' must not be empty, or must be a list``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# A union branch tag, not a field name: type names and validator descriptions.
_TAG = re.compile(r"[\[\](),<> ]|^(str|int|float|bool|list|dict|none|constrained-\w+)$")

_PHRASES = {
    "missing": "is required",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "list_type": "must be a list",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "finite_number": "must be a finite number",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "literal_error": "must be {expected}",
    "int_parsing": "must be an integer",
    "string_unicode": "must be valid Unicode",
}


def field_path(loc: Sequence[Any]) -> str:
    """``('body', 'messages', 0, 'role')`` -> ``messages[0].role``; union tags dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "body" and not _TAG.search(str(part)):
            path += ("." if path else "") + str(part)
    return path


def _phrase(err: dict) -> str:
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    if kind in ("too_short", "too_long"):
        bound = ctx.get("min_length" if kind == "too_short" else "max_length")
        if kind == "too_short" and bound == 1:
            return "must not be empty"
        unit = "characters" if "string" in err.get("msg", "").lower() else "items"
        return f"must have {'at least' if kind == 'too_short' else 'at most'} {bound} {unit}"
    if kind == "value_error":
        return str(ctx.get("error") or err.get("msg", "is invalid"))
    template = _PHRASES.get(kind)
    if template:
        try:
            return template.format(**ctx)
        except (KeyError, IndexError):
            pass
    msg = str(err.get("msg") or "is invalid")
    return "is invalid: " + msg[:1].lower() + msg[1:]


def _union_base(loc: Sequence[Any]) -> Sequence[Any] | None:
    """The part of ``loc`` before its first union tag (None when it has none)."""
    for i, part in enumerate(loc):
        if not isinstance(part, int) and _TAG.search(str(part)):
            return loc[:i]
    return None


def describe(errors: Sequence[dict],
             union_rules: dict[str, str] | None = None) -> tuple[str, str | None]:
    """One sentence for a list of pydantic errors, and the first field's name (the ``param``).

    ``union_rules`` words the errors of a union-typed field by the field's name (``"stop":
    "must be a string or a list of strings"``) instead of one phrase per branch. A
    ``value_error`` raised by a model validator has no field and is worded as raised.
    """
    by_path: dict[str, list[str]] = {}
    for err in errors:
        loc, phrase = err.get("loc", ()), None
        base = _union_base(loc)
        if base is not None and union_rules:
            names = [p for p in base if isinstance(p, str) and p != "body"]
            phrase = union_rules.get(names[-1]) if names else None
            loc = base if phrase else loc
        phrase = phrase or _phrase(err)
        phrases = by_path.setdefault(field_path(loc), [])
        if phrase not in phrases:
            phrases.append(phrase)
    parts = []
    for path, phrases in list(by_path.items())[:3]:
        said = ", or ".join(phrases)
        parts.append(f"'{path}' {said}" if path else said)
    first = next(iter(by_path), "")
    sentence = "Invalid request: " + "; ".join(parts) + "."
    return sentence, (first.split(".")[0].split("[")[0] or None)
