"""Structured output and tools on /v1/chat/completions and /v1/completions, on the fake engine
with the real grammar compiler (bundled tokenizer): the constraint each request hands the
engine, the prompt tools put in front of the model, the shape of tool calls (whole and
streamed, read by the official ``openai`` client), and every bad input a 400 naming it while
the server keeps serving.
"""

from __future__ import annotations

import json

import openai
import pytest
from fake_engine import FakeEngine

from kvledger.server.tools.formats import HERMES

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "strict": True,
    "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                   "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
ARGS = ['{"city": "Paris"}', "{}"]
CALLS_TEXT = (HERMES.call_text("get_weather", ARGS[0]) + "\n"
              + HERMES.call_text("get_time", ARGS[1]))
SCHEMA = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class RecordingEngine(FakeEngine):
    """FakeEngine that replies ``text`` and keeps each request's prompt and params."""

    max_model_len = 4096  # room for the tool declarations (one token per character)

    def __init__(self, grammars, text: str) -> None:
        super().__init__(text=text)
        self.grammars = grammars
        self.seen: list[tuple] = []
        self.templated: list = []  # chat messages as the template receives them

    def tokenize(self, prompt, add_special_tokens: bool = True, tools=None) -> list[int]:
        self.templated.append(prompt)
        return super().tokenize(prompt, add_special_tokens, tools)

    def add_request(self, request_id, prompt, params, cache_salt=None) -> None:
        self.seen.append((prompt, params))
        super().add_request(request_id, prompt, params, cache_salt)


@pytest.fixture
def serve(make_client, grammars):
    """``serve(text) -> (openai client, engine)``."""
    def make(text: str = "plain answer"):
        engine = RecordingEngine(grammars, text)
        client = make_client(engine)
        return openai.OpenAI(base_url="http://testserver/v1", api_key="none",
                             http_client=client, max_retries=0), engine
    return make


def test_response_format_and_structured_outputs_reach_the_engine(serve):
    oc, engine = serve('{"a": 1}')
    r = oc.chat.completions.create(model="fake-model", messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].message.content == '{"a": 1}' and r.choices[0].finish_reason == "stop"
    oc.chat.completions.create(model="fake-model", messages=ASK,
                               response_format={"type": "json_object"})
    oc.completions.create(model="fake-model", prompt="x",
                          extra_body={"structured_outputs": {"regex": "[0-9]+"}})
    oc.chat.completions.create(model="fake-model", messages=ASK,
                               extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    got = [p.structured_outputs for _, p in engine.seen]
    assert got[0].json == SCHEMA and got[1].json == {"type": "object"}
    assert got[2].regex == "[0-9]+" and got[3].choice == ("yes", "no")


def test_tools_are_declared_in_the_system_message_and_history_rendered(serve):
    oc, engine = serve()
    history = [{"role": "system", "content": "Be brief."}, *ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": ARGS[0]}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    oc.chat.completions.create(model="fake-model", messages=history, tools=[WEATHER])
    (_, params), messages = engine.seen[0], engine.templated[0]
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\n")
    declared = messages[0]["content"].split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(declared) == WEATHER
    assert messages[2] == {"role": "assistant",
                           "content": HERMES.call_text("get_weather", ARGS[0])}
    # the fake tokenizer renders no template: a user turn naming the function
    assert messages[3] == {"role": "user", "content": "get_weather returned: 21 C"}
    assert "get_weather" in params.structured_outputs.grammar


def test_tool_calls_whole_and_streamed(serve):
    oc, _ = serve("Let me check. " + CALLS_TEXT)
    r = oc.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER, TIME])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "  # as generated, as streamed
    assert [(c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls] \
        == [("function", "get_weather", ARGS[0]), ("function", "get_time", ARGS[1])]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    chunks = list(oc.chat.completions.create(model="fake-model", messages=ASK,
                                             tools=[WEATHER, TIME], stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    firsts = [c for c in calls if c.id is not None]
    assert [(c.index, c.type, c.function.name, c.function.arguments) for c in firsts] == \
        [(0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    for call in calls:
        if call.id is None:  # later chunks: index and an arguments fragment only
            assert call.type is None and call.function.name is None and call.function.arguments
    for i in (0, 1):
        assert "".join(c.function.arguments for c in calls if c.index == i) == ARGS[i]
    assert "".join(d.content or "" for d in deltas) == "Let me check. "
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


def test_a_reply_without_calls_is_content(serve):
    oc, _ = serve("No tool needed.")
    r = oc.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER])
    assert r.choices[0].message.content == "No tool needed."
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"$ref": "https://example.com/s.json"}}}}, "response_format",
     "https://example.com/s.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "nonsense"}}}}, "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs", "grammar"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools",
     "name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two tools are named 'get_weather'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
    ({"messages": ASK + [{"role": "tool", "content": "21 C"}]}, "messages", "tool_call_id"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "c9", "content": "21 C"}]},
     "messages", "no earlier assistant message"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {
        "type": "json_object"}}, "tool_choice", "conflicts with the JSON response format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {
        "name": "get_weather"}}, "response_format": {"type": "json_object"}}, "tool_choice",
     "conflicts"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {}}}}}}]}, "tools",
     "tool 'f': the json schema cannot be enforced: Unimplemented keys: [\"not\"]"),
])
def test_bad_input_is_a_400_naming_it_and_the_server_keeps_serving(make_client, grammars,
                                                                    body, param, words):
    client = make_client(RecordingEngine(grammars, "ok"))
    resp = client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert words in error["message"] and error["param"] == param, error
    assert error["code"] in (None, "unsupported_parameter"), error  # never the type again
    ok = client.post("/v1/chat/completions", json={"messages": ASK})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"


def test_an_engine_without_grammars_refuses_structured_output(make_client):
    resp = make_client().post("/v1/chat/completions", json={
        "messages": ASK, "response_format": {"type": "json_object"}})
    assert resp.status_code == 400 and "not available" in resp.json()["error"]["message"]


UNSATISFIABLE = [
    {"structured_outputs": {"regex": r"[^\x00-\x{10FFFF}]"}},
    {"structured_outputs": {"grammar": "start: /[^\\x00-\\U0010FFFF]/"}},
    {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"$ref": "#"}}}},
    {"structured_outputs": {"json": {"$defs": {"a": {"$ref": "#/$defs/b"},
                                               "b": {"$ref": "#/$defs/a"}},
                                     "$ref": "#/$defs/a"}}},
]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("body", UNSATISFIABLE, ids=["regex", "lark", "ref-self", "ref-loop"])
def test_a_constraint_no_output_can_match_is_a_400_not_an_empty_stop(make_client, grammars,
                                                                     route, body):
    """Before issue 61: 200, text "", finish_reason "stop"."""
    if route == "/v1/completions" and "response_format" in body:
        body = {"structured_outputs": {"json": {"$ref": "#"}}}
    client = make_client(RecordingEngine(grammars, ""))
    prompt = {"messages": ASK} if route.endswith("chat/completions") else {"prompt": "x"}
    resp = client.post(route, json={**prompt, **body})
    assert resp.status_code == 400, resp.text
    assert "matches no output" in resp.json()["error"]["message"]


SIZE_LIMITED = [
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(5000)]},
     "tools", "--max-tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}}}},
     "response_format", "--max-schema-properties"),
    ({"structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}},
     "structured_outputs", "--max-grammar-alternatives"),
    ({"tools": [{"type": "function", "function": {"name": f"f{t}", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}}}
        for t in range(2)]}, "tools", "--max-schema-properties"),
]


@pytest.mark.parametrize("body, param, option", SIZE_LIMITED, ids=[
    "5000-tools", "10000-properties", "100000-choices", "tools-1200-properties-together"])
def test_a_request_over_a_size_limit_is_a_400_before_any_compile(make_client, grammars, body,
                                                                  param, option, monkeypatch):
    """Before issue 61: 400 after 6-30 s with a Rust panic or a parser-state dump. Now the
    limit is checked before the grammar is compiled: nothing reaches the compile thread."""
    compiled = []
    monkeypatch.setattr(grammars, "_compile", lambda *args: compiled.append(args))
    client = make_client(RecordingEngine(grammars, "ok"))
    resp = client.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert option in error["message"] and error["param"] == param, error
    assert compiled == []


def test_the_grammar_cache_bytes_are_in_metrics(make_client, grammars):
    class Engine(RecordingEngine):
        def stats(self) -> dict:  # as LLMEngine.stats reports its compiler's cache
            return {**super().stats(), "grammar_cache_bytes": self.grammars.cache.nbytes}

    client = make_client(Engine(grammars, "yes"))
    assert client.post("/v1/chat/completions", json={"messages": ASK, "structured_outputs": {
        "choice": ["yes", "no"]}}).status_code == 200
    lines = [line for line in client.get("/metrics").text.splitlines()
             if line.startswith("kvledger:grammar_cache_bytes{")]
    assert len(lines) == 1 and float(lines[0].split()[-1]) == grammars.cache.nbytes > 0


def test_an_output_short_of_its_constraint_is_a_400_of_its_own_code():
    from kvledger.engine.output.request_output import RequestOutput
    from kvledger.server.openai.streaming import engine_error

    out = RequestOutput("r", [1])
    out.error = "structured output failed: the output ended before the constraint was complete"
    status, body = engine_error(out)
    assert (status, body["error"]["code"]) == (400, "structured_output_failed")
