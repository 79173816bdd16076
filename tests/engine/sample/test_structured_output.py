"""Structured output through the engine: every constrained output parses, validates against its
schema (``jsonschema``, the oracle) and ends with ``stop``; a constrained request leaves the
other requests of its batch as they were.

A tiny random Llama with the bundled tokenizer's 49,152 ids keeps these fast: its near-uniform
logits wander wherever the grammar lets them, so every bound in the schemas matters; the
bundled model's variant (``LLM``, chat prompts) is marked slow.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError

POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                        "y": {"type": "number", "minimum": 0, "maximum": 1}}}
# bounded everywhere, so that a random model finishes: strings, arrays, numbers
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                    "tags": {"type": "array", "maxItems": 3,
                             "items": {"enum": ["red", "green", "blue"]}},
                    "nick": {"type": "string", "maxLength": 5}}},
    {"$defs": {"point": POINT}, "type": "object", "additionalProperties": False,
     "required": ["start", "end"],
     "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"},
                    "label": {"anyOf": [{"type": "null"},
                                        {"type": "string", "pattern": "^[a-z]{1,6}$"}]}}},
    {"type": "array", "minItems": 1, "maxItems": 4,
     "items": {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
               "properties": {"id": {"type": "integer", "exclusiveMinimum": 0, "maximum": 999},
                              "ok": {"type": "boolean"}}}},
]
PROMPT = "Answer in JSON."


@pytest.fixture(scope="module")
def engine(tiny_llama_folder):
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    folder = tiny_llama_folder(vocab=49152)  # the bundled tokenizer's ids; EOS 2 = <|im_end|>
    spec, weights = load_weights(folder, torch.float32)
    return LLMEngine(EngineConfig(model=str(folder), dtype="fp32"), spec=spec, weights=weights,
                     tokenizer=load_tokenizer("default"))


def _run(engine, requests: list[tuple[str, SamplingParams]]) -> dict:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[f"r{i}"] for i in range(len(requests))]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["nested-enum-optional", "ref-anyof", "array"])
def test_json_schema_outputs_validate_and_stop(engine, schema):
    params = [SamplingParams(max_tokens=400, temperature=t, seed=s,
                             structured_outputs={"json": schema})
              for t, s in ((0.0, None), (1.0, 1))]
    for out in _run(engine, [(PROMPT, p) for p in params]):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_choice_and_grammar(engine):
    cases = [({"regex": r"[0-9]{3}-[a-z]{2,4}"},
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
             ({"choice": ["alpha", "beta", "gamma"]}, lambda t: t in ("alpha", "beta", "gamma")),
             ({"grammar": 'root ::= "(" [0-9] ("+" [0-9])? ")"'},
              lambda t: re.fullmatch(r"\([0-9](\+[0-9])?\)", t))]
    outs = _run(engine, [(PROMPT, SamplingParams(max_tokens=300, temperature=1.0, seed=3,
                                                 structured_outputs=c)) for c, _ in cases])
    for (constraint, check), out in zip(cases, outs):
        assert out.finish_reason == "stop" and check(out.text), (constraint, out.text)


def test_a_constrained_request_leaves_its_batch_neighbours_alone(engine):
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = _run(engine, [("Tell me a story.", free)])[0].token_ids
    constrained = SamplingParams(max_tokens=50, temperature=0.0,
                                 structured_outputs={"json": SCHEMAS[0]})
    batched = _run(engine, [("Tell me a story.", free), (PROMPT, constrained)])
    assert batched[0].token_ids == alone


def test_an_unsupported_schema_is_refused_and_nothing_is_queued(engine):
    params = SamplingParams(structured_outputs={"json": {"type": "array", "uniqueItems": True}})
    with pytest.raises(InvalidParameterError, match="uniqueItems"):
        engine.add_request("bad", PROMPT, params)
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_bundled_model_json_outputs_validate_and_stop():
    """The issue's check through the Python API: real chat prompts, the bundled model."""
    from kvledger import LLM

    llm = LLM()
    cases = [
        ("Write a JSON object with the keys name and age for Alice, who is 30.",
         {"type": "object"}),
        ("Describe a person (name, age, favourite colours) as JSON.", SCHEMAS[0]),
        ("Give a line segment as JSON: start and end points, and a short label.", SCHEMAS[1]),
        ("List two tasks as JSON, each with an id and whether it is done.", SCHEMAS[2]),
        ("Give the weather in Paris as JSON.",
         {"type": "object", "required": ["city", "celsius", "sky"],
          "properties": {"city": {"type": "string", "maxLength": 40},
                         "celsius": {"type": "number", "minimum": -60, "maximum": 60},
                         "sky": {"enum": ["sunny", "cloudy", "rain"]}}}),
    ]
    prompts = [[{"role": "user", "content": text}] for text, _ in cases]
    params = [SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=(
        {"json_object": True} if s == {"type": "object"} else {"json": s})) for _, s in cases]
    for (_, schema), out in zip(cases, llm.generate(prompts, params)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_an_output_that_ends_short_of_its_grammar_is_an_error_not_stop(engine):
    """An errored matcher (here one whose language is empty, past the compiler) allows only the
    end of output; before issue 61 that ended ``stop`` with an empty text."""
    from llguidance import LLMatcher

    engine.add_request("short", PROMPT, SamplingParams(max_tokens=8,
                                                       structured_outputs={"regex": "[0-9]+"}))
    request = engine.scheduler.requests["short"]
    request.grammar = LLMatcher(engine.grammars._llg_tokenizer(),
                                LLMatcher.grammar_from_regex(r"[^\x00-\x{10FFFF}]"), log_level=0)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.finish_reason == "error"
    assert "ended before the constraint was complete" in final.error
    assert request.params.structured_outputs.key not in engine.grammars.cache  # compiled anew


def test_the_grammar_cache_bytes_are_in_the_engine_stats(engine):
    from kvledger.engine.sample.structured.constraint import StructuredOutputsParams

    constraint = StructuredOutputsParams(json={"enum": ["a", "b", "c"]})
    engine.grammars.matcher(constraint)
    assert constraint.key in engine.grammars.cache
    assert engine.stats()["grammar_cache_bytes"] == engine.grammars.cache.nbytes > 0
