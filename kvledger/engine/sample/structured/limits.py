"""GrammarLimits: how large a constraint may be, checked before it is compiled.

Compiling costs time and memory that grow with the constraint (10,000 optional properties took
about 30 s, a choice of 100,000 strings 19 s), so a constraint over any of these limits is
refused at once, naming the limit and its option:

- ``max_grammar_bytes``: the constraint's text (the schema as JSON, the regex, the grammar, the
  choices);
- ``max_schema_properties``: properties a JSON schema declares, all objects together;
- ``max_grammar_alternatives``: the strings of a ``choice``, or a schema's ``enum`` values and
  ``anyOf`` / ``oneOf`` branches, all together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvledger.errors import InvalidParameterError


class GrammarTooLargeError(InvalidParameterError):
    """A constraint over one of the :class:`GrammarLimits` (HTTP 400)."""


@dataclass(frozen=True)
class GrammarLimits:
    """The size limits of one constraint (see the module docstring)."""

    max_grammar_bytes: int = 512 << 10
    max_schema_properties: int = 1000
    max_grammar_alternatives: int = 10_000

    def check(self, constraint) -> None:
        """Refuse a ``StructuredOutputsParams`` over a limit.

        Raises:
            GrammarTooLargeError: naming the limit, the constraint's figure and the option.
        """
        label = constraint.label
        properties, alternatives = 0, 0
        if constraint.json is not None:
            properties, alternatives = _schema_counts(constraint.json)
        elif constraint.choice is not None:
            alternatives = len(constraint.choice)
        _check(label, properties, "properties", self.max_schema_properties,
               "max-schema-properties")
        _check(label, alternatives, "alternatives (choices, enum values, anyOf/oneOf branches)",
               self.max_grammar_alternatives, "max-grammar-alternatives")
        size = len(constraint.key.encode()) - len(constraint.kind) - 1
        _check(label, size, "bytes", self.max_grammar_bytes, "max-grammar-bytes")


def _check(label: str, figure: int, unit: str, limit: int, option: str) -> None:
    if figure > limit:
        raise GrammarTooLargeError(f"the {label} has {figure} {unit}; this server compiles at "
                                   f"most {limit} (--{option})")


def _schema_counts(schema: Any) -> tuple[int, int]:
    """(properties, alternatives) declared anywhere in a JSON schema."""
    properties = alternatives = 0
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
            for key in ("enum", "anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    alternatives += len(node[key])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return properties, alternatives
