"""GrammarCompiler: compiled off the calling thread, cached by constraint, refusals named."""

from __future__ import annotations

import threading

import pytest

from kvledger.engine.sample.structured.constraint import (
    MAX_JSON_WHITESPACE,
    StructuredOutputsParams,
)
from kvledger.errors import InvalidParameterError


def _consumes(matcher, tokenizer, text: str) -> bool:
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_compiles_in_its_worker_thread_and_caches_by_schema(grammars, monkeypatch):
    threads = []
    original = StructuredOutputsParams.grammar_text

    def spy(self):
        threads.append(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(StructuredOutputsParams, "grammar_text", spy)
    a = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "string"}}})
    b = StructuredOutputsParams(json={"properties": {"k": {"type": "string"}}, "type": "object"})
    first = grammars.submit(a)
    assert grammars.submit(b) is first  # the same schema, keys in another order
    first.result()
    assert len(threads) == 1 and threads[0].startswith("kvl-grammar")
    assert grammars.matcher(a) is not grammars.matcher(b)  # each request its own copy


@pytest.mark.parametrize("schema, named", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "string", "format": "color"}, "format: color"),
    ({"$ref": "#/$defs/missing"}, "/\\$defs/missing"),
])
def test_an_unsupported_schema_feature_is_refused_naming_it(grammars, schema, named):
    with pytest.raises(InvalidParameterError, match=f"json schema cannot be enforced: .*{named}"):
        grammars.matcher(StructuredOutputsParams(json=schema))


def test_a_grammar_that_does_not_parse_is_refused(grammars):
    with pytest.raises(InvalidParameterError, match="grammar"):
        grammars.matcher(StructuredOutputsParams(grammar='root ::= ("a"'))


def test_json_whitespace_is_bounded(grammars, bundled_tokenizer):
    constraint = StructuredOutputsParams(json_object=True)
    pad = " " * MAX_JSON_WHITESPACE
    assert _consumes(grammars.matcher(constraint), bundled_tokenizer, '{"a":' + pad + "1}")
    assert not _consumes(grammars.matcher(constraint), bundled_tokenizer,
                         '{"a":' + pad + " 1}")
    assert not _consumes(grammars.matcher(constraint), bundled_tokenizer, ' {"a": 1}')


def test_gbnf_and_lark_grammars_both_compile(grammars, bundled_tokenizer):
    gbnf = 'root ::= "yes" | "no"'
    lark = 'start: "yes" | "no"'
    for text in (gbnf, lark):
        assert _consumes(grammars.matcher(StructuredOutputsParams(grammar=text)),
                         bundled_tokenizer, "no")
        assert not _consumes(grammars.matcher(StructuredOutputsParams(grammar=text)),
                             bundled_tokenizer, "maybe")
