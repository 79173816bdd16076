"""No request field is silently ignored: every field of the official ``openai`` client's request
types is implemented (declared by our model), refused away from its neutral value, or a
documented hint (server/openai/api_fields.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvledger.server.openai.api_fields import HINTS
from kvledger.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvledger.server.responses.protocol import ResponsesRequest

sys.path.insert(0, str(Path(__file__).parents[1] / "sessions"))


def _client_fields(module: str) -> set[str]:
    import importlib

    return set(importlib.import_module(module).CompletionCreateParamsBase.__annotations__
               if "responses" not in module else
               importlib.import_module(module).ResponseCreateParamsBase.__annotations__)


@pytest.mark.parametrize(("model", "module"), [
    (CompletionRequest, "openai.types.completion_create_params"),
    (ChatCompletionRequest, "openai.types.chat.completion_create_params"),
    (ResponsesRequest, "openai.types.responses.response_create_params"),
])
def test_every_client_field_is_implemented_refused_or_a_hint(model, module):
    fields = _client_fields(module)
    undecided = sorted(fields - set(model.model_fields) - set(model.unsupported) - HINTS)
    assert not undecided, f"implement, refuse (api_fields.py) or list as a hint: {undecided}"


@pytest.mark.parametrize(("field", "value"), [
    ("text", {"verbosity": "high"}),
    ("reasoning", {"effort": "high"}),
    ("include", ["message.output_text.logprobs"]),
    ("top_logprobs", 3),
    ("background", True),
    ("conversation", "conv_123"),
    ("prompt", {"id": "pmpt_1"}),
    ("service_tier", "priority"),
])
def test_responses_fields_it_cannot_honour_are_400(make_client, field, value):
    from session_fakes import ChatFakeEngine

    client = make_client(ChatFakeEngine())
    r = client.post("/v1/responses", json={"input": "hi", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert r.json()["error"]["code"] == "unsupported_parameter"


def test_built_in_tools_are_400_naming_the_field(make_client):
    from session_fakes import ChatFakeEngine

    r = make_client(ChatFakeEngine()).post("/v1/responses", json={
        "input": "hi", "tools": [{"type": "web_search"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "'function'" in r.json()["error"]["message"], r.text


def test_wrong_api_structured_output_field_says_which_to_use(make_client):
    from session_fakes import ChatFakeEngine

    client = make_client(ChatFakeEngine())
    r = client.post("/v1/responses", json={"input": "hi", "response_format": {
        "type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "text.format" in r.json()["error"]["message"]
    r = make_client().post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": "object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"
    assert "structured_outputs" in r.json()["error"]["message"]
    ok = client.post("/v1/responses", json={"input": "hi", "text": {"format": {"type": "text"}},
                                            "reasoning": {}, "include": [], "user": "u1",
                                            "prompt_cache_key": "k", "service_tier": "auto"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("field", "value"), [("reasoning_effort", "low"), ("store", True),
                                              ("verbosity", "low"),
                                              ("web_search_options", {"search_context_size":
                                                                      "low"})])
def test_chat_fields_it_cannot_honour_are_400(make_client, field, value):
    r = make_client().post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_tools_on_completions_are_400(make_client):
    r = make_client().post("/v1/completions", json={"prompt": "hi", "tools": [
        {"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
