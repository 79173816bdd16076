"""StructuredOutputsParams: the constraint one request's output must match.

Exactly one of: a JSON schema (``json``), any JSON object (``json_object``), a regular
expression (``regex``, Rust ``regex`` syntax), one of a list of strings (``choice``), or a
grammar (``grammar``: GBNF as llama.cpp writes it, or llguidance's Lark syntax). Field names are
vLLM's ``StructuredOutputsParams``. :meth:`StructuredOutputsParams.grammar_text` turns the
constraint into the grammar llguidance compiles (its JSON Schema subset:
https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md).

JSON output has bounded whitespace: at most :data:`MAX_JSON_WHITESPACE` whitespace characters
between two tokens of JSON, none before or after the value, so a constrained output cannot loop
in whitespace. A schema's ``$ref`` must point inside the schema (``#``, ``#/$defs/...``); any
other is refused, naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kvledger.errors import InvalidParameterError

LABELS = {"json": "json schema", "json_object": "json object", "regex": "regex",
          "choice": "choice", "grammar": "grammar"}
MAX_JSON_WHITESPACE = 16  # whitespace characters allowed between two JSON tokens
WHITESPACE_OPTIONS = {"whitespace_flexible": True,
                      "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_JSON_WHITESPACE}}}"}


def json_schema_options(schema: dict) -> dict:
    """``schema`` with kvledger's JSON compile options in its ``x-guidance`` key (llguidance
    applies them over any the schema has), for a schema embedded in a Lark grammar."""
    return {**schema, "x-guidance": WHITESPACE_OPTIONS}


def check_refs(schema: Any, path: str = "#") -> None:
    """Refuse a ``$ref`` that leaves the schema.

    Raises:
        InvalidParameterError: naming the first ``$ref`` that does not start with ``#``.
    """
    if isinstance(schema, dict):
        ref = schema.get("$ref")
        if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
            raise InvalidParameterError(
                f"json schema: $ref {ref!r} at {path} points outside the schema; only refs "
                "within it are resolved (such as '#/$defs/name')")
        for key, value in schema.items():
            check_refs(value, f"{path}/{key}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            check_refs(value, f"{path}/{i}")


def _schema(value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidParameterError(f"json schema is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidParameterError(
            f"json schema must be a JSON object, got {type(value).__name__}")
    check_refs(value)
    return value


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (exactly one field set).

    Attributes:
        json: a JSON schema (a dict, or its JSON text).
        json_object: True for any JSON object.
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these non-empty strings.
        grammar: a GBNF grammar (root rule ``root``) or a Lark grammar (``start:``).

    Raises:
        InvalidParameterError: on construction, none or several set, or a bad value.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameterError(
                "structured output takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        if self.json_object is not False and self.json_object is not True:
            raise InvalidParameterError("json_object must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidParameterError(f"{name} must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, list | tuple) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidParameterError("choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict) -> StructuredOutputsParams:
        """A StructuredOutputsParams, or one built from a dict of its fields.

        Raises:
            InvalidParameterError: not a dict, unknown keys, or a bad value.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidParameterError(
                f"structured_outputs must be an object, got {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidParameterError(
                f"structured_outputs has unknown keys: {', '.join(unknown)} (known: json, "
                "json_object, regex, choice, grammar)")
        return cls(**value)

    @property
    def kind(self) -> str:
        """The field that is set (``json``, ``json_object``, ``regex``, ``choice``,
        ``grammar``)."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def label(self) -> str:
        """What the constraint is, in words (``json schema``, ``regex``, ...)."""
        return LABELS[self.kind]

    @property
    def key(self) -> str:
        """A canonical string of the constraint: equal constraints compile once."""
        value = getattr(self, self.kind)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint (not yet checked against a tokenizer).

        Raises:
            InvalidParameterError: a GBNF grammar that does not parse; a schema with an integer
                past 64 bits (llguidance's serialiser refuses it with a ValueError).
        """
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            try:
                return LLMatcher.grammar_from_json_schema(schema, overrides=WHITESPACE_OPTIONS)
            except ValueError as exc:
                raise InvalidParameterError(
                    f"the json schema cannot be compiled: {str(exc)[:80]} (integers in a "
                    "schema must fit 64 bits)") from None
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # one lexeme: a parser rule of over 2,000 alternatives
            return LLMatcher.grammar_from_lark(  # fails at the first token (llguidance's row)
                "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in self.choice))
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(self.grammar))
        except Exception as exc:  # noqa: BLE001 - the converter raises its own error types
            raise InvalidParameterError(f"grammar does not parse: {exc}") from None
