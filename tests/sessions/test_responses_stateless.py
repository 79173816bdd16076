"""Stateless Responses turns (fake engine, real grammar compiler), through the official
``openai`` client: ``input`` carrying the whole conversation (messages, function calls, their
outputs, reasoning) as the OpenAI Agents SDK sends it, with or without ``previous_response_id``;
``store: false``; ``include``. The expected prompts are written out by hand in the fake
template's layout (``<|role|>content<|end|>\\n``, Hermes calls for a template without tools)."""

from __future__ import annotations

import openai
import pytest
from session_fakes import ChatFakeEngine, openai_client

from kvledger.server.tools.formats import hermes_system_text

TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "required": ["city"],
                       "properties": {"city": {"type": "string"}}}}
ARGS = '{"city": "Paris"}'
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGS,
        "id": "fc_1", "status": "completed"}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}
TOOL_TURN = "<|tool|>21 C<|end|>\n<|assistant|>"  # the fake template writes a tool turn


@pytest.fixture
def serve(make_app, grammars):
    """``serve(text) -> (openai client, TestClient, prompts seen as text)``."""
    def make(text: str):
        engine = ChatFakeEngine(text=text)
        engine.grammars = grammars
        seen = []
        add = engine.add_request
        engine.add_request = lambda rid, prompt, params, cache_salt=None: (
            seen.append("".join(map(chr, prompt))), add(rid, prompt, params, cache_salt))[1]
        client = make_app(engine)
        return openai_client(client), client, seen
    return make


def test_the_whole_conversation_without_previous_response_id(serve):
    oc, _, seen = serve("It is 21 C.")
    assistant = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                 "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]}
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text",
                                                                "text": "think"}]}
    r = oc.responses.create(model="fake-model", tools=[TOOL],
                            input=[USER, reasoning, assistant, CALL, RESULT])
    assert r.output_text == "It is 21 C." and r.status == "completed"
    system = "<|system|>" + hermes_system_text([{"type": "function", "function": {
        k: v for k, v in TOOL.items() if k != "type"}}]) + "<|end|>\n"
    assert seen[0] == (system + "<|user|>Weather in Paris?<|end|>\n"
                       + "<|assistant|>Checking.\n" + CALL_TEXT + "<|end|>\n" + TOOL_TURN)


def test_streamed_stateless_turn_completes(serve):
    oc, _, seen = serve("It is 21 C.")
    events = list(oc.responses.create(model="fake-model", tools=[TOOL], stream=True,
                                      input=[USER, CALL, RESULT]))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "It is 21 C."
    assert seen[0].endswith("<|assistant|>" + CALL_TEXT + "<|end|>\n" + TOOL_TURN)


def test_items_continue_the_stored_conversation(serve):
    oc, client, seen = serve("Sure.")
    first = oc.responses.create(model="fake-model", input="Hello", extra_body={"memory": "full"})
    oc.responses.create(model="fake-model", previous_response_id=first.id,
                        extra_body={"memory": "full"}, input=[
                            {"role": "assistant", "content": "An aside."},
                            {"role": "user", "content": "Go on"}])
    stored = client.app.state.sessions.store.get_response("", first.id)
    assert seen[1] == "".join(map(chr, stored.token_ids)) + (
        "<|end|>\n<|assistant|>An aside.<|end|>\n<|user|>Go on<|end|>\n<|assistant|>")


def test_a_call_output_answers_a_call_of_the_input_or_the_previous_response(serve):
    oc, _, _ = serve("ok")
    with pytest.raises(openai.BadRequestError, match="no function call with call_id 'call_2'"):
        oc.responses.create(model="fake-model", tools=[TOOL], input=[
            USER, CALL, RESULT, {**RESULT, "call_id": "call_2"}])
    first = oc.responses.create(model="fake-model", input="hi")
    with pytest.raises(openai.BadRequestError, match="'input' or the previous response"):
        oc.responses.create(model="fake-model", previous_response_id=first.id, input=[RESULT])
    assert oc.responses.create(model="fake-model", previous_response_id=first.id,
                               input=[CALL, RESULT]).status == "completed"


def test_store_false_keeps_nothing(serve):
    oc, client, _ = serve("ok")
    r = oc.responses.create(model="fake-model", store=False, input=[USER, CALL, RESULT])
    assert r.store is False and r.output_text == "ok"
    with pytest.raises(openai.NotFoundError):
        oc.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oc.responses.create(model="fake-model", previous_response_id=r.id, input="more")
    assert client.app.state.sessions.store.sessions("") == []


def test_include_is_honoured_or_refused_by_value(serve):
    oc, _, _ = serve("ok")
    r = oc.responses.create(model="fake-model", input="hi",
                            include=["reasoning.encrypted_content"])
    assert r.output_text == "ok" and [i.type for i in r.output] == ["message"]
    with pytest.raises(openai.BadRequestError, match="'message.output_text.logprobs'") as e:
        oc.responses.create(model="fake-model", input="hi",
                            include=["message.output_text.logprobs"])
    assert e.value.body["param"] == "include"
