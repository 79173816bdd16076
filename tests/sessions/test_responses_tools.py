"""Tools and text.format on /v1/responses (fake engine, real grammar compiler), through the
official ``openai`` client: function_call items whole and streamed, the call's result fed back
with function_call_output into the stored conversation, the echoed format, and 400s."""

from __future__ import annotations

import json

import openai
import pytest
from session_fakes import ChatFakeEngine, openai_client

from kvledger.server.tools.formats import HERMES, hermes_system_text

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "strict": True, "parameters": {"type": "object", "required": ["city"],
                                       "properties": {"city": {"type": "string"}}}}
ARGS = '{"city": "Paris"}'
REPLY = "Checking. " + HERMES.call_text("get_weather", ARGS)


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.fixture
def serve(make_app, grammars):
    """``serve(text) -> (openai client, TestClient, engine)``."""
    def make(text: str):
        engine = ChatFakeEngine(text=text)
        engine.grammars = grammars
        seen = engine.seen = []
        add = engine.add_request
        engine.add_request = lambda rid, prompt, params, cache_salt=None: (
            seen.append((prompt, params)), add(rid, prompt, params, cache_salt))[1]
        client = make_app(engine)
        return openai_client(client), client, engine
    return make


def test_a_call_comes_back_as_a_function_call_item(serve):
    oc, _, engine = serve(REPLY)
    r = oc.responses.create(model="fake-model", input="Weather in Paris?", tools=[TOOL])
    message, call = r.output
    assert message.type == "message" and message.content[0].text == "Checking. "
    assert (call.type, call.name, call.arguments, call.status) == \
        ("function_call", "get_weather", ARGS, "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert r.tool_choice == "auto" and r.parallel_tool_calls is True
    assert [t.name for t in r.tools] == ["get_weather"] and r.tools[0].strict is True
    prompt, params = engine.seen[0]
    text = "".join(map(chr, prompt))
    assert text.startswith("<|system|>" + hermes_system_text([]).split("<tools>")[0])
    declared = text.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(declared) == {"type": "function", "function": {
        k: v for k, v in TOOL.items() if k != "type"}}
    assert "get_weather" in params.structured_outputs.grammar


def test_streamed_events_of_text_then_a_call(serve):
    oc, _, _ = serve(REPLY)
    events = list(oc.responses.create(model="fake-model", input="Weather?", tools=[TOOL],
                                      stream=True))
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added",
            "response.content_part.added"]
    middle = ["response.output_text.done", "response.content_part.done",
              "response.output_item.done", "response.output_item.added"]
    tail = ["response.function_call_arguments.done", "response.output_item.done",
            "response.completed"]
    assert kinds[:4] == head and kinds[-3:] == tail
    at = kinds.index("response.output_text.done")
    assert set(kinds[4:at]) == {"response.output_text.delta"}
    assert kinds[at:at + 4] == middle
    assert set(kinds[at + 4:-3]) == {"response.function_call_arguments.delta"}
    assert "".join(e.delta for e in events if e.type.endswith("arguments.delta")) == ARGS
    assert [e.output_index for e in events if "function_call" in e.type] == \
        [1] * (len(kinds) - at - 6)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.model_dump() for i in done] == [i.model_dump() for i in events[-1].response.output]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_call_output_continues_the_stored_conversation(serve):
    oc, client, engine = serve(HERMES.call_text("get_weather", ARGS))
    first = oc.responses.create(model="fake-model", input="Weather?", tools=[TOOL],
                                tool_choice="required", extra_body={"memory": "full"})
    call = first.output[0]
    oc.responses.create(model="fake-model", previous_response_id=first.id, tools=[TOOL],
                        input=[{"type": "function_call_output", "call_id": call.call_id,
                                "output": "21 C"}], extra_body={"memory": "full"})
    stored = client.app.state.sessions.store.get_response("", first.id)
    turn = "<|tool|>21 C<|end|>\n<|assistant|>"  # the fake template writes a tool turn
    assert engine.seen[1][0] == stored.token_ids + _ids("<|end|>\n" + turn)
    retrieved = oc.responses.retrieve(first.id)
    assert retrieved.output[0].type == "function_call" and retrieved.output[0].arguments == ARGS


def test_text_format_is_enforced_and_echoed(serve):
    oc, _, engine = serve('{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = oc.responses.create(model="fake-model", input="a?", text={"format": {
        "type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    assert r.output_text == '{"a": 1}'
    assert r.text.format.type == "json_schema" and r.text.format.strict is True
    assert engine.seen[0][1].structured_outputs.json == schema


@pytest.mark.parametrize("body, words", [
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
     "function_call 'c' in 'input' has no function_call_output"),
    ({"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "ends with an assistant message"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]},
     "no function call with call_id 'c' in 'input'"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "'nope'"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "needs 'name' and 'schema'"),
    ({"tools": [{**TOOL, "parameters": {"type": "array", "uniqueItems": True}}]},
     "uniqueItems"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#"}}}},
     "matches no output"),
    ({"tools": [{**TOOL, "name": f"f{i}"} for i in range(129)]}, "--max-tools"),
])
def test_bad_input_is_a_400(serve, body, words):
    oc, _, _ = serve("ok")
    with pytest.raises(openai.BadRequestError, match=words):
        oc.responses.create(model="fake-model", **{"input": "hi", **body})
    assert oc.responses.create(model="fake-model", input="hi").output_text == "ok"


def test_a_schema_the_grammar_refuses_names_text_format(serve):
    oc, _, _ = serve("ok")
    with pytest.raises(openai.BadRequestError) as caught:
        oc.responses.create(model="fake-model", input="hi", text={"format": {
            "type": "json_schema", "name": "x", "schema": {"$ref": "https://example.com/s"}}})
    error = caught.value.body
    assert (error["param"], error["code"]) == ("text.format", None), error


def test_a_call_output_must_answer_a_call_of_the_previous_response(serve):
    oc, _, _ = serve(HERMES.call_text("get_weather", ARGS))
    first = oc.responses.create(model="fake-model", input="Weather?", tools=[TOOL],
                                tool_choice="required")
    answer = [{"type": "function_call_output", "call_id": "call_nope", "output": "21 C"}]
    with pytest.raises(openai.BadRequestError, match="no function call with call_id 'call_nope'"):
        oc.responses.create(model="fake-model", previous_response_id=first.id, tools=[TOOL],
                            input=answer)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oc.responses.create(model="fake-model", tools=[TOOL], input=answer)
    with pytest.raises(openai.NotFoundError):
        oc.responses.create(model="fake-model", previous_response_id="resp_gone", input=answer)
    answer[0]["call_id"] = first.output[0].call_id
    assert oc.responses.create(model="fake-model", previous_response_id=first.id, tools=[TOOL],
                               input=answer).status == "completed"
