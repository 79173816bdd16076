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


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 10**20},
                                    {"type": "array", "maxItems": 1 << 70},
                                    {"type": "integer", "minimum": 10**400}])
def test_a_schema_integer_past_64_bits_is_refused(grammars, schema):
    """Old code (485cae7): llguidance's ValueError "Value is not JSON serializable" escaped as
    no user error (the server's 500)."""
    with pytest.raises(InvalidParameterError, match="must fit 64 bits"):
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


EMPTY_LANGUAGES = [
    {"regex": r"[^\x00-\x{10FFFF}]"},
    {"grammar": "start: /[^\\x00-\\U0010FFFF]/"},
    {"json": {"$ref": "#"}},
    {"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
              "$ref": "#/$defs/a"}},
]


@pytest.mark.parametrize("fields", EMPTY_LANGUAGES, ids=["regex", "lark", "ref-self", "ref-loop"])
def test_a_constraint_no_output_can_match_is_refused_at_compile_time(grammars, fields):
    constraint = StructuredOutputsParams(**fields)
    with pytest.raises(InvalidParameterError, match="matches no output") as refused:
        grammars.matcher(constraint)
    assert "<state>" not in str(refused.value) and "Parser" not in str(refused.value)


def test_a_constraint_that_fails_is_never_cached(grammars, monkeypatch):
    compiled = []
    original = StructuredOutputsParams.grammar_text

    def spy(self):
        compiled.append(self.key)
        return original(self)

    monkeypatch.setattr(StructuredOutputsParams, "grammar_text", spy)
    constraint = StructuredOutputsParams(regex=r"x[^\x00-\x{10FFFF}]")
    for _ in range(2):
        with pytest.raises(InvalidParameterError):
            grammars.matcher(constraint)
    assert len(compiled) == 2  # compiled again, refused again: no cached failure


def test_a_regex_whose_lexer_overflows_is_refused_at_compile_time_every_time(grammars):
    """``b{3}((a{100}){100}){100}``: the first mask took 1.6 s (+177 MB) in the engine thread and
    left the shared lexer over llguidance's limits, so every later copy failed at once (``""``,
    ``stop``). Now the compile thread computes the first masks and refuses it, each time."""
    constraint = StructuredOutputsParams(regex="b{3}((a{100}){100}){100}")
    for _ in range(2):
        with pytest.raises(InvalidParameterError, match="too large or complex") as refused:
            grammars.matcher(constraint)
        assert "<" not in str(refused.value)  # no <state> / <non-verbose/> / <backtrace>


def test_a_small_cache_budget_keeps_the_bytes_under_it(grammars):
    """Six grammars under a budget of four times one grammar's least size (32 bytes per
    character of its text; the measured RSS growth, when larger, counts instead)."""
    from kvledger.engine.sample.structured.compiler import BYTES_PER_GRAMMAR_CHAR, GrammarCompiler

    enums = [StructuredOutputsParams(json={"enum": [f"v{i}-{k}" for k in range(2000)]})
             for i in range(6)]
    least = min(BYTES_PER_GRAMMAR_CHAR * len(c.grammar_text()) for c in enums)
    small = GrammarCompiler(grammars._tokenizer, grammars.vocab_size, grammars._eos,
                            cache_bytes=4 * least)
    small._lltokenizer = grammars._llg_tokenizer()
    for constraint in enums:
        small.matcher(constraint)
    assert 0 < small.cache.nbytes <= 4 * least
    assert len(small.cache) <= 4


def test_a_choice_of_thousands_of_strings_is_enforced_past_its_first_token(grammars,
                                                                          bundled_tokenizer):
    """As one rule of 10,000 alternatives it failed at the first token (llguidance's limit of
    2,000 items in a parser row); as one lexeme it holds."""
    choices = [f"option-{i}" for i in range(10_000)]
    matcher = grammars.matcher(StructuredOutputsParams(choice=choices))
    assert _consumes(matcher, bundled_tokenizer, "option-9876")
    assert matcher.is_accepting() and not matcher.is_error()
