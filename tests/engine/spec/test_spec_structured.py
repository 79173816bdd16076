"""Speculation under structured output: the grammar advances only on accepted tokens and a
proposal is cut at the first token the grammar refuses, so the constrained greedy outputs are
those of plain decoding, and each validates against its schema (``jsonschema``)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvledger.engine.sample.sampling_params import SamplingParams

# bounded everywhere, so that the random model finishes
SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age"],
     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130}}},
    {"type": "array", "minItems": 1, "maxItems": 4, "items": {"enum": ["red", "green"]}},
    {"type": "object", "additionalProperties": False, "required": ["ok"],
     "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}}},
]

PROMPTS = ["Answer in JSON.", "Reply with JSON only.", "JSON, please."]


@pytest.fixture(scope="module")
def build(tiny_llama_folder):
    import torch

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    folder = tiny_llama_folder(vocab=49152)  # the bundled tokenizer's ids
    spec, weights = load_weights(folder, torch.float32)
    tokenizer = load_tokenizer("default")

    def make(**options):
        return LLMEngine(EngineConfig(model=str(folder), dtype="fp32", **options), spec=spec,
                         weights=weights, tokenizer=tokenizer)
    return make


def _run(engine) -> list:
    for i, (prompt, schema) in enumerate(zip(PROMPTS, SCHEMAS)):
        engine.add_request(f"r{i}", prompt, SamplingParams(
            max_tokens=120, temperature=0.0, structured_outputs={"json": schema}))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[f"r{i}"] for i in range(len(PROMPTS))]


def test_constrained_greedy_equals_plain_with_cut_proposals(build):
    plain = _run(build())
    engine = build(speculative_config={"method": "ngram", "gate": False})
    prompts = {tuple(engine.tokenize(p)): o.token_ids for p, o in zip(PROMPTS, plain)}
    offered = []

    def propose(tokens, k):
        """Two right tokens, a wrong one, then a token outside JSON ('\\x07' is never allowed
        there): the wrong one is cut (outside the grammar) or rejected in the verify."""
        prompt = next(p for p in prompts if tuple(tokens[:len(p)]) == p)
        want = prompts[prompt][len(tokens) - len(prompt):]
        draft = (want[:2] + [want[2] + 1 if len(want) > 2 else 0] + [engine.tokenize(
            "\x07", add_special_tokens=False)[0]])[:k]
        offered.append(len(draft))
        return draft, "ngram"

    engine.speculator.proposer.propose = propose
    spec = _run(engine)
    for a, b, schema in zip(plain, spec, SCHEMAS):
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason == "stop"
        jsonschema.validate(json.loads(b.text), schema)
    s = engine.stats()
    assert s["spec_accepted_tokens"] > 0
    assert s["spec_proposed_tokens"] < sum(offered)  # grammar cuts happened


def test_stop_strings_cut_inside_a_verify(build):
    """A stop string met at an accepted proposal ends the output there, as in plain decoding
    (the random model's text under a greedy loop repeats, so proposals are accepted)."""
    def run(engine):
        params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
        engine.add_request("free", "Say something.", params)
        texts = {}
        while engine.has_unfinished_requests():
            texts.update({o.request_id: o for o in engine.step() if o.finished})
        free = texts["free"].text
        stop = free[len(free) * 2 // 3: len(free) * 2 // 3 + 3]  # met late, inside a loop
        engine.add_request("stopped", "Say something.", SamplingParams(
            max_tokens=80, temperature=0.0, ignore_eos=True, stop=[stop]))
        while engine.has_unfinished_requests():
            texts.update({o.request_id: o for o in engine.step() if o.finished})
        return texts["stopped"]

    plain = run(build())
    engine = build(speculative_config={"method": "ngram", "gate": False})
    spec = run(engine)
    assert (spec.text, spec.finish_reason) == (plain.text, plain.finish_reason)
    assert plain.finish_reason == "stop"
    assert engine.stats()["spec_accepted_tokens"] > 0
