"""The tables of ``docs/validation.md``, made from the code: every numeric field of every
request body (from the bodies' pydantic models), of a model spec (``spec/ranges.py``) and every
numeric command-line option (``commands/option_ranges.py``).

``tests/test_validation_doc.py`` checks that the page holds exactly these tables;
``python tests/validation_table.py`` rewrites them in the page after a change.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kvledger.commands.option_ranges import OPTION_RANGES
from kvledger.ledger.retention import MAX_TOKENS
from kvledger.ranges import Range
from kvledger.server.dashboard.routes import PlanRequest
from kvledger.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
)
from kvledger.server.responses.protocol import ResponsesRequest
from kvledger.spec.ranges import ROPE_SCALING_RANGES, SPEC_RANGES

DOC = Path(__file__).resolve().parents[1] / "docs" / "validation.md"
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/v1/responses": ResponsesRequest, "/detokenize": DetokenizeRequest,
          "/dashboard/api/plan": PlanRequest}
"""Route -> the model of its JSON body (the routes with numeric fields; ``/tokenize`` has
none)."""
ALSO = {
    "max_tokens": "prompt + it over the context: 400 `context_length_exceeded`",
    "max_completion_tokens": "as max_tokens",
    "max_output_tokens": "as max_tokens",
    "prompt[]": "an id past the vocabulary: 400",
    "prompt[][]": "an id past the vocabulary: 400",
    "tokens[]": "an id past the vocabulary: 400",
    "logit_bias.*": "keys: token ids (ASCII digits) inside the vocabulary, else 400",
    "top_logprobs": "needs logprobs true",
    "kv_policy.budget": "h2o: at least sinks + window + 1; snapkv: above its observation window",
}
"""Field -> the rule checked beside its range, when the request is added."""
KV_POLICY = {"kv_policy.window": Range(1, MAX_TOKENS, optional=True),
             "kv_policy.sinks": Range(0, MAX_TOKENS, optional=True),
             "kv_policy.budget": Range(1, MAX_TOKENS, optional=True)}
"""The numbers of ``kv_policy`` (an object the retention spec checks: ``ledger/retention.py``),
on every route that samples."""
SAMPLING_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def http_fields() -> dict[tuple[str, str], Range]:
    """(route, field path) -> its allowed range, for every numeric field of every body."""
    out = {}
    for route, model in BODIES.items():
        out.update({(route, path): allowed for path, allowed in numeric_fields(model).items()})
        if route in SAMPLING_ROUTES:
            out.update({(route, path): allowed for path, allowed in KV_POLICY.items()})
    return out


def _range(schema: dict, nullable: bool) -> Range:
    lo = schema.get("minimum", schema.get("exclusiveMinimum"))
    hi = schema.get("maximum", schema.get("exclusiveMaximum"))
    return Range(lo, hi, integer=schema["type"] == "integer",
                 lo_open="exclusiveMinimum" in schema, hi_open="exclusiveMaximum" in schema,
                 optional=nullable)


def numeric_fields(model) -> dict[str, Range]:
    """Path (``logit_bias.*``, ``prompt[]``) -> range of every numeric leaf of ``model``'s
    JSON schema, in every branch of its unions."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    out: dict[str, Range] = {}

    def walk(node: dict, path: str, nullable: bool, seen: frozenset) -> None:
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            if name not in seen:
                walk(defs[name], path, nullable, seen | {name})
            return
        branches = node.get("anyOf") or node.get("oneOf")
        if branches:
            nullable = any(b.get("type") == "null" for b in branches)
            for branch in branches:
                walk(branch, path, nullable, seen)
            return
        kind = node.get("type")
        if kind in ("integer", "number"):
            out.setdefault(path, _range(node, nullable))
        elif kind == "array" and isinstance(node.get("items"), dict):
            walk(node["items"], path + "[]", False, seen)
        elif kind == "object":
            for name, sub in node.get("properties", {}).items():
                walk(sub, f"{path}.{name}" if path else name, False, seen)
            if isinstance(node.get("additionalProperties"), dict):
                walk(node["additionalProperties"], path + ".*", False, seen)

    walk(schema, "", False, frozenset())
    return out


def _rows(header: str, rows: list[tuple[str, ...]]) -> str:
    cells = header.split(" | ")
    lines = ["| " + header + " |", "|" + " --- |" * len(cells)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def http_table() -> str:
    rows = [(f"`{route}`", f"`{path}`", allowed.text(), ALSO.get(path, ""))
            for (route, path), allowed in http_fields().items()]
    return _rows("route | field | allowed | also checked", rows)


def spec_table() -> str:
    rows = [(f"`{name}`", allowed.text()) for name, allowed in SPEC_RANGES.items()]
    rows += [(f"`rope_scaling.{name}`", allowed.text())
             for name, allowed in ROPE_SCALING_RANGES.items()]
    return _rows("field | allowed", rows)


def cli_table() -> str:
    rows = [(f"`--{name.replace('_', '-')}`", allowed.text().removesuffix(" or none"))
            for name, allowed in sorted(OPTION_RANGES.items())]
    return _rows("option (parameter name) | allowed", rows)


TABLES = {"http": http_table, "spec": spec_table, "cli": cli_table}


def block(name: str, text: str) -> str:
    """The page's text between ``<!-- table:NAME -->`` and ``<!-- end -->``."""
    match = re.search(rf"<!-- table:{name} -->\n(.*?)<!-- end -->", text, re.DOTALL)
    return match.group(1).rstrip("\n") if match else ""


def rewrite(text: str) -> str:
    for name, make in TABLES.items():
        table = make()
        text = re.sub(rf"(<!-- table:{name} -->\n).*?(<!-- end -->)",
                      lambda m, t=table: m.group(1) + t + "\n" + m.group(2), text, flags=re.DOTALL)
    return text


if __name__ == "__main__":
    DOC.write_text(rewrite(DOC.read_text()))
    sys.exit(0)
