"""Structured output and tool calls on a live ``kvledger serve`` (bundled SmolLM2-135M-Instruct),
through the official ``openai`` client, on both APIs, streamed and whole.

Every constrained reply must end with ``stop`` (or ``tool_calls``), parse, and validate with
``jsonschema`` (the oracle); a tool call goes through a tool result to a final answer; an
unsupported schema feature is a 400 naming it and the server keeps serving.
"""

from __future__ import annotations

import json
import sys

import jsonschema
import openai
import pytest
from serve_process import ServeProcess, free_port

pytestmark = pytest.mark.slow

SERVE = "import typer; from kvledger.commands.serve import serve; typer.run(serve)"
ADDRESS = {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30},
                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}
PERSON = {  # nested object through $ref, enums in an array, optional fields, bounds, patterns
    "$defs": {"address": ADDRESS}, "type": "object", "additionalProperties": False,
    "required": ["name", "age", "address"],
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 30},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.com$"},
                   "address": {"$ref": "#/$defs/address"},
                   "colors": {"type": "array", "maxItems": 3,
                              "items": {"enum": ["red", "green", "blue"]}}}}
ORDER = {  # an array of objects, a bounded number, an enum
    "type": "object", "additionalProperties": False, "required": ["lines", "total", "status"],
    "properties": {"lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
        "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                       "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
                   "total": {"type": "number", "minimum": 0, "maximum": 10000},
                   "status": {"enum": ["pending", "shipped"]}}}
CASES = [("Describe Ada, 36, who lives in London, as JSON.", PERSON),
         ("Write an order of two items as JSON.", ORDER)]
WEATHER = {"name": "get_weather", "description": "Current weather of a city", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 30}}}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    port = free_port()
    folder = tmp_path_factory.mktemp("structured")
    server = ServeProcess([sys.executable, "-c", SERVE, "--port", str(port), "--state-db",
                           str(folder / "state.sqlite3")], folder / "server.log", port)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                        timeout=600)
    server.close()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _chat_text(client, model, stream: bool, **kwargs) -> tuple[str, str]:
    if not stream:
        choice = client.chat.completions.create(model=model, temperature=0, **kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = list(client.chat.completions.create(model=model, temperature=0, stream=True,
                                                 **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks[-1].choices[0].finish_reason


def _responses_text(client, model, stream: bool, **kwargs) -> tuple[str, str]:
    if not stream:
        r = client.responses.create(model=model, temperature=0, **kwargs)
        return r.output_text, r.status
    events = list(client.responses.create(model=model, temperature=0, stream=True, **kwargs))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return text, events[-1].response.status


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("prompt, schema", CASES, ids=["person", "order"])
def test_json_schema_replies_validate_on_both_apis(client, model, prompt, schema, stream):
    fmt = {"name": "reply", "schema": schema, "strict": True}
    text, finish = _chat_text(client, model, stream, max_tokens=400,
                              messages=[{"role": "user", "content": prompt}],
                              response_format={"type": "json_schema", "json_schema": fmt})
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)
    text, status = _responses_text(client, model, stream, input=prompt, max_output_tokens=400,
                                   store=False, text={"format": {"type": "json_schema", **fmt}})
    assert status == "completed", text
    jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_json_object(client, model):
    ask = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    text, finish = _chat_text(client, model, False, messages=ask, max_tokens=20,
                              extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert finish == "stop" and text in ("yes", "no")
    date = [{"role": "user", "content": "What is the date of the French national day?"}]
    text, finish = _chat_text(client, model, True, messages=date, max_tokens=20, extra_body={
        "structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    assert finish == "stop" and len(text) == 10 and text[4] == text[7] == "-"
    alice = [{"role": "user", "content": "Write a JSON object with the keys name and age for "
                                         "Alice, who is 30."}]
    text, finish = _chat_text(client, model, False, messages=alice, max_tokens=200,
                              response_format={"type": "json_object"})
    assert finish == "stop" and isinstance(json.loads(text), dict)


def test_chat_tool_call_round_trip_and_streamed_arguments(client, model):
    tools = [{"type": "function", "function": WEATHER}]
    messages = [{"role": "user", "content": ASK}]
    first = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                           tool_choice="required", temperature=0,
                                           parallel_tool_calls=False).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    (call,) = first.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="required", temperature=0,
        parallel_tool_calls=False, stream=True))
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == ""
    streamed = json.loads("".join(c.function.arguments for c in calls))
    # a prefix hit may round bf16 differently and pick other whitespace between JSON tokens
    assert streamed == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id,
                  "content": json.dumps({"celsius": 21, "sky": "sunny"})}]
    final = client.chat.completions.create(model=model, messages=messages, tools=tools,
                                           tool_choice="none", temperature=0,
                                           max_tokens=80).choices[0]
    assert final.finish_reason in ("stop", "length") and final.message.content
    assert final.message.tool_calls is None


def test_responses_tool_call_round_trip(client, model):
    tools = [{"type": "function", **WEATHER, "strict": True}]
    events = list(client.responses.create(model=model, input=ASK, tools=tools,
                                          tool_choice={"type": "function",
                                                       "name": "get_weather"},
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and kinds[-2:] == [
        "response.output_item.done", "response.completed"]
    first = events[-1].response
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert "".join(e.delta for e in events if e.type.endswith("arguments.delta")) == \
        call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    final = client.responses.create(
        model=model, previous_response_id=first.id, tools=tools, tool_choice="none",
        temperature=0, max_output_tokens=80,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    assert final.status in ("completed", "incomplete") and final.output_text
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id


def test_unsupported_feature_is_a_400_and_the_server_keeps_serving(client, model):
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}})
    text, finish = _chat_text(client, model, False, max_tokens=5,
                              messages=[{"role": "user", "content": "hi"}])
    assert text and finish in ("stop", "length")
