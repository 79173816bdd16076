"""StructuredOutputsParams: one constraint, checked on construction; refs stay in the schema."""

from __future__ import annotations

import pytest

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
from kvledger.errors import InvalidParameterError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, message", [
    ({}, "got none"),
    ({"json": SCHEMA, "regex": "a+"}, "got json, regex"),
    ({"json": [1]}, "must be a JSON object"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": 3}, "grammar must be a non-empty string"),
    ({"choice": []}, "choice must be a list of non-empty strings"),
    ({"choice": ["a", ""]}, "choice must be a list of non-empty strings"),
    ({"json_object": "yes"}, "json_object must be true or false"),
])
def test_bad_constraints_are_refused_with_the_reason(fields, message):
    with pytest.raises(InvalidParameterError, match=message):
        StructuredOutputsParams(**fields)


@pytest.mark.parametrize("ref", ["http://example.com/s.json", "other.json#/a", "/abs"])
def test_a_ref_outside_the_schema_is_refused_naming_it(ref):
    schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
    with pytest.raises(InvalidParameterError, match=f"\\$ref '{ref}' at #/properties/a"):
        StructuredOutputsParams(json=schema)


def test_refs_within_the_schema_are_kept():
    schema = {"$defs": {"p": {"type": "integer"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#"}}}
    assert StructuredOutputsParams(json=schema).json == schema


def test_json_text_is_parsed_and_equal_constraints_share_a_key():
    a = StructuredOutputsParams(json='{"type": "object", "required": ["a"]}')
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert a.json == b.json and a.key == b.key
    assert a.key != StructuredOutputsParams(json_object=True).key
    assert StructuredOutputsParams(choice=["x", "y"]).kind == "choice"


def test_sampling_params_takes_a_dict_and_refuses_unknown_keys():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(InvalidParameterError, match="unknown keys: jsn"):
        SamplingParams(structured_outputs={"jsn": SCHEMA})
    with pytest.raises(InvalidParameterError, match="must be an object"):
        SamplingParams(structured_outputs="json")
