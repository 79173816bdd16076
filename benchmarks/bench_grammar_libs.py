"""xgrammar vs llguidance on the bundled tokenizer (49,152 ids): the measurements behind the
choice of the grammar library (issue 40).

For each library:

- **mask time**: 16 matchers of one typical schema walk the tokens of a valid instance in
  lock step; each step fills the packed bitmask ``[16, 1536]`` int32 for all 16 (the library's
  batch call) and then every matcher accepts its next token. Per-step fill and accept times,
  first walk (cold: lazily built lexer states) and the median of later walks (warm).
- **compile time** of the typical schema: first (fresh compiler) and again (the library's
  cache: xgrammar's compiler cache; llguidance has none, so the cached form is a pristine
  matcher that is ``deep_copy``-ed).
- **correctness**: for a handful of schemas, hand-written instances judged by ``jsonschema``
  (the oracle) are fed to each library; a library is right on an instance when it accepts
  exactly the valid ones. Schemas the library refuses are listed with its message; a keyword
  it ignores without a word shows up as an invalid instance it accepts.

xgrammar is not a dependency of kvledger (its wheel requires triton): install it for this script
with ``pip install --no-deps xgrammar apache-tvm-ffi``; a library that is not installed is
skipped. A timing figure: run it alone on the machine.

    python benchmarks/bench_grammar_libs.py [--walks 5] [--batch 16] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
import torch
from common import machine_line

TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
TYPICAL_INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org",
                    "tags": ["red", "blue"], "address": {"city": "London", "zip": "12345"}}

POINT = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
         "required": ["x", "y"], "additionalProperties": False}
# (name, schema, instances); each instance's validity comes from jsonschema, not from here
CASES = [
    ("nested/enum/bounds/pattern", TYPICAL, [
        TYPICAL_INSTANCE, {"name": "Bo", "age": 0, "tags": ["green"]},
        {"name": "", "age": 3, "tags": ["red"]}, {"name": "A", "age": 131, "tags": ["red"]},
        {"name": "A", "age": -1, "tags": ["red"]}, {"name": "A", "age": 1.5, "tags": ["red"]},
        {"name": "A", "tags": ["red"]}, {"name": "A", "age": 3, "tags": ["pink"]},
        {"name": "A", "age": 3, "tags": []},
        {"name": "A", "age": 3, "tags": ["red", "red", "red", "red"]},
        {"name": "A", "age": 3, "tags": ["red"], "address": {"zip": "12345"}},
        {"name": "A", "age": 3, "tags": ["red"], "address": {"city": "X", "zip": "1234"}},
        {"name": "A", "age": 3, "email": "A@b.cd", "tags": ["red"]},
        {"name": "A", "age": 3, "tags": ["red"], "extra": 1}]),
    ("$ref/$defs + anyOf null", {
        "$defs": {"point": POINT}, "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"},
                       "label": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["start", "end", "label"], "additionalProperties": False}, [
        {"start": {"x": 0, "y": 1.5}, "end": {"x": -2e3, "y": 4}, "label": None},
        {"start": {"x": 0, "y": 1}, "end": {"x": 1, "y": 1}, "label": "ab"},
        {"start": {"x": 0}, "end": {"x": 1, "y": 1}, "label": None},
        {"start": {"x": 0, "y": 1}, "end": {"x": 1, "y": 1}, "label": 3}]),
    ("recursive $ref", {
        "$defs": {"node": {"type": "object", "properties": {
            "value": {"type": "integer"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["value"], "additionalProperties": False}},
        "$ref": "#/$defs/node"}, [
        {"value": 1, "children": [{"value": 2}, {"value": 3, "children": []}]},
        {"value": 1, "children": [{"children": []}]}]),
    ("exclusive bounds, number range", {
        "type": "object", "properties": {
            "p": {"type": "number", "minimum": 0, "maximum": 1},
            "n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["p", "n"], "additionalProperties": False}, [
        {"p": 0.25, "n": 9}, {"p": 1, "n": 1}, {"p": 1.5, "n": 3}, {"p": 0.5, "n": 0},
        {"p": 0.5, "n": 10}]),
    ("const, oneOf", {
        "type": "object", "properties": {
            "kind": {"const": "event"},
            "size": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}},
        "required": ["kind", "size"], "additionalProperties": False}, [
        {"kind": "event", "size": 3}, {"kind": "event", "size": "xl"},
        {"kind": "other", "size": 3}, {"kind": "event", "size": "xxl"}]),
    ("additionalProperties schema, minProperties", {
        "type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1}, [
        {"a": 1, "b": 2}, {}, {"a": "x"}]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [
        [1, 2, 3], [1, 1]]),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, [10, 7]),
    ("format date / email", {
        "type": "object", "properties": {"at": {"type": "string", "format": "date"},
                                         "to": {"type": "string", "format": "email"}},
        "required": ["at", "to"], "additionalProperties": False}, [
        {"at": "2024-05-01", "to": "a@b.io"}, {"at": "yesterday", "to": "a@b.io"},
        {"at": "2024-05-01", "to": "nobody"}]),
]


def _dumps(value) -> str:
    return json.dumps(value, separators=(", ", ": "))


class XGrammar:
    """xgrammar 0.2.x: TokenizerInfo, GrammarCompiler (cached), GrammarMatcher."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int, threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.threads = threads
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema):
        return self.compiler.compile_json_schema(schema, any_whitespace=True,
                                                 max_whitespace_cnt=4)

    def fresh_compiler(self) -> None:
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def accepts_text(self, compiled, text: str) -> bool:
        m = self.matcher(compiled)
        return m.accept_string(text) and m.is_completed()


class LLGuidance:
    """llguidance 1.x: LLTokenizer, grammar_from_json_schema, LLMatcher, LLExecutor."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab: int, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.lltorch = llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.cache: dict[str, object] = {}

    def compile(self, schema):
        key = json.dumps(schema, sort_keys=True)
        if key not in self.cache:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,4}"})
            matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(matcher.get_error())
            self.cache[key] = matcher
        return self.cache[key]

    def fresh_compiler(self) -> None:
        self.cache.clear()

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers, bitmask) -> None:
        self.lltorch.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def accepts_text(self, compiled, text: str) -> bool:
        m = self.matcher(compiled)
        ids = self.tok.tokenize_str(text)
        return all(m.consume_token(t) for t in ids) and m.is_accepting()


def mask_times(lib, tokenizer, batch: int, walks: int, vocab: int) -> dict:
    """Per-step fill and accept times (ms) of ``batch`` matchers walking TYPICAL_INSTANCE."""
    compiled = lib.compile(TYPICAL)
    ids = tokenizer.encode(_dumps(TYPICAL_INSTANCE), add_special_tokens=False)
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    per_walk = []
    for _ in range(walks):
        matchers = [lib.matcher(compiled) for _ in range(batch)]
        fill, accept = [], []
        for token in ids:
            t0 = time.perf_counter()
            lib.fill(matchers, bitmask)
            t1 = time.perf_counter()
            ok = [lib.accept(m, token) for m in matchers]
            t2 = time.perf_counter()
            assert all(ok), f"{lib.name} refused a token of the valid instance"
            assert bitmask[0, token // 32] >> (token % 32) & 1, "mask excludes the next token"
            fill.append(t1 - t0)
            accept.append(t2 - t1)
        per_walk.append((statistics.mean(fill) * 1e3, statistics.mean(accept) * 1e3))
    warm = per_walk[1:] or per_walk
    return {"tokens": len(ids), "fill_ms_first": per_walk[0][0],
            "fill_ms_warm": statistics.median(w[0] for w in warm),
            "accept_ms_warm": statistics.median(w[1] for w in warm)}


def compile_times(lib) -> dict:
    """Seconds to compile TYPICAL with a fresh cache, then again."""
    lib.fresh_compiler()
    t0 = time.perf_counter()
    compiled = lib.compile(TYPICAL)
    lib.matcher(compiled)
    t1 = time.perf_counter()
    lib.matcher(lib.compile(TYPICAL))
    t2 = time.perf_counter()
    return {"compile_ms_first": (t1 - t0) * 1e3, "compile_ms_cached": (t2 - t1) * 1e3}


def correctness(lib) -> dict:
    """Per schema: instances judged as jsonschema judges them, or the library's refusal."""
    rows = {}
    for name, schema, instances in CASES:
        try:
            compiled = lib.compile(schema)
        except Exception as exc:  # noqa: BLE001 - a refusal is a result here
            rows[name] = f"refused: {str(exc).splitlines()[0][:90]}"
            continue
        wrong = []
        for inst in instances:
            valid = jsonschema.Draft202012Validator(
                schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
            ).is_valid(inst)
            if lib.accepts_text(compiled, _dumps(inst)) != valid:
                wrong.append(("accepted invalid " if not valid else "refused valid ")
                             + _dumps(inst))
        rows[name] = (f"{len(instances) - len(wrong)}/{len(instances)}"
                      + (f" wrong: {'; '.join(wrong)[:160]}" if wrong else ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from kvledger.model.weights.loader import load_tokenizer

    tokenizer = load_tokenizer("default")
    vocab = len(tokenizer)
    print(machine_line(args.threads))
    print(f"tokenizer: bundled SmolLM2, {vocab} ids; batch {args.batch}; "
          f"{args.threads} grammar threads")
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        try:
            lib = cls(tokenizer, vocab, args.threads)
        except ImportError as exc:
            print(f"\n## {cls.name}: not installed ({exc})")
            continue
        setup = time.perf_counter() - t0
        comp = compile_times(lib)
        masks = mask_times(lib, tokenizer, args.batch, args.walks, vocab)
        print(f"\n## {lib.name}: tokenizer setup {setup:.2f} s; typical schema compile "
              f"{comp['compile_ms_first']:.1f} ms first, {comp['compile_ms_cached']:.3f} ms "
              f"cached")
        print(f"mask fill per step at batch {args.batch} ({masks['tokens']} steps): "
              f"{masks['fill_ms_first']:.3f} ms first walk, {masks['fill_ms_warm']:.3f} ms warm;"
              f" accept {masks['accept_ms_warm']:.3f} ms per step")
        for name, row in correctness(lib).items():
            print(f"  {name}: {row}")


if __name__ == "__main__":
    main()
