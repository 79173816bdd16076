"""GrammarLimits: constraints over a size limit refused before compiling, naming the option."""

from __future__ import annotations

import pytest

from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
from kvledger.engine.sample.structured.limits import GrammarLimits, GrammarTooLargeError

MANY_PROPERTIES = {"type": "object",
                   "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}


@pytest.mark.parametrize("fields, option", [
    ({"json": MANY_PROPERTIES}, "--max-schema-properties"),
    ({"choice": [f"c{i}" for i in range(100_000)]}, "--max-grammar-alternatives"),
    ({"json": {"anyOf": [{"const": i} for i in range(6000)],
               "properties": {"a": {"enum": list(range(6000))}}}}, "--max-grammar-alternatives"),
    ({"regex": "a" * 600_000}, "--max-grammar-bytes"),
], ids=["properties", "choice", "enum-and-anyOf", "bytes"])
def test_a_constraint_over_a_limit_is_refused_at_once_by_the_compiler(grammars, fields, option):
    """Before issue 61 these compiled for 12-30 s (or panicked): now refused by the limit
    (the error names the option) before anything is compiled."""
    with pytest.raises(GrammarTooLargeError, match=option):
        grammars.submit(StructuredOutputsParams(**fields))


def test_the_limits_count_every_object_of_a_schema():
    nested = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {}, "y": {}}},
        "b": {"type": "array", "items": {"type": "object", "properties": {"z": {}}}}}}
    GrammarLimits(max_schema_properties=5).check(StructuredOutputsParams(json=nested))
    with pytest.raises(GrammarTooLargeError, match="has 5 properties.*at most 4"):
        GrammarLimits(max_schema_properties=4).check(StructuredOutputsParams(json=nested))
