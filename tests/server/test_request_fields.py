"""Every request field honoured or refused: readable 400s, unsupported fields, defaults, lists
of prompts, and the server's own limits on stop strings."""

import json
import logging

import pytest
from fake_engine import TEXT

from kvledger.server.limits.server_limits import ServerLimits

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": " \n\t "}, "prompt"),  # the CLI's rule: blank is empty
    ("/v1/completions", {"prompt": ["ok", "  "]}, "prompt"),
    ("/tokenize", {"prompt": "   "}, "prompt"),
])
def test_400s_are_sentences_naming_the_field(make_client, route, body, param):
    err = _error(make_client().post(route, json=body), 400)
    message = err["message"]
    assert err["param"] == param and f"'{param}" in message
    for leak in ("function-after", "0x", "functools", "constrained", "list[", "Input should"):
        assert leak not in message, message
    assert message.endswith(".") and message[0].isupper()


def test_nan_and_infinity_are_refused(make_client):
    body = b'{"prompt": "x", "temperature": NaN}'  # Python's JSON parser accepts NaN
    resp = make_client().post("/v1/completions", content=body,
                              headers={"content-type": "application/json"})
    assert _error(resp, 400)["param"] == "temperature"
    body = b'{"prompt": "x", "top_p": Infinity}'
    resp = make_client().post("/v1/completions", content=body,
                              headers={"content-type": "application/json"})
    assert _error(resp, 400)["param"] == "top_p"


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "required"),
    ("suffix", "end"),
    ("best_of", 2),
])
def test_unimplemented_fields_are_400_naming_the_field(make_client, field, value):
    resp = make_client().post("/v1/completions", json={"prompt": "x", field: value})
    err = _error(resp, 400)
    assert err["param"] == field and err["code"] == "unsupported_parameter"
    assert f"'{field}'" in err["message"]


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "text"}), ("tools", []), ("tool_choice", "none"),
    ("tool_choice", "auto"),  # without tools, "auto" calls none
    ("suffix", None), ("best_of", 1),
])
def test_neutral_values_of_unimplemented_fields_are_accepted(make_client, field, value):
    resp = make_client().post("/v1/completions", json={"prompt": "x", field: value})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 5), ("frequency_penalty", -2.5), ("repetition_penalty", 0),
    ("min_p", 1.5), ("logit_bias", {"28": 101}), ("logit_bias", {"x": 1}),
    ("logit_bias", {"-3": 1}),
    ("logit_bias", {"\u00b2": 1}),  # old code: "²".isdigit(), int("²") fails: a 500
    ("logit_bias", {"\u0663": 1}),  # an Arabic-Indic 3: token ids are ASCII digits
])
def test_out_of_range_values_are_400(make_client, field, value):
    resp = make_client().post("/v1/completions", json={"prompt": "x", field: value})
    assert _error(resp, 400)["param"] == field


def test_penalties_and_logit_bias_reach_the_sampling_params(make_client):
    from fake_engine import FakeEngine

    engine = FakeEngine()
    seen = []
    add = engine.add_request
    engine.add_request = lambda rid, prompt, params, **kw: (seen.append(params),
                                                            add(rid, prompt, params, **kw))[1]
    resp = make_client(engine).post("/v1/completions", json={
        "prompt": "x", "max_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -0.25,
        "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": {"28": 100, "3": -7.5}})
    assert resp.status_code == 200, resp.text
    p = seen[0]  # before the fix these fields were dropped and decoding ignored them
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (
        0.5, -0.25, 1.2, 0.1)
    assert p.logit_bias == {28: 100.0, 3: -7.5}


def test_unknown_fields_are_logged_and_ignored(make_client, caplog):
    caplog.set_level(logging.WARNING, logger="kvledger.server")
    resp = make_client().post("/v1/chat/completions", json={**CHAT, "frobnicate": 1,
                                                            "metadata": {"a": "b"}})
    assert resp.status_code == 200
    warned = [r.getMessage() for r in caplog.records if "unknown request" in r.getMessage()]
    assert warned == ["/v1/chat/completions: ignoring unknown request fields: frobnicate"]


def test_completions_default_to_16_tokens(make_client):
    # OpenAI's legacy completions and vLLM; before: up to the whole context
    body = make_client().post("/v1/completions", json={"prompt": "x", "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_defaults_to_the_context_limit(make_client):
    body = make_client().post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "ignore_eos": True}).json()
    prompt = body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 256 - prompt  # FakeEngine.max_model_len


@pytest.mark.parametrize("prompt", [["ab", "cde"], [[97, 98], [99, 100, 101]]])
def test_a_list_of_prompts_gives_one_choice_each(make_client, prompt):
    client = make_client()
    body = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == [TEXT[:3]] * 2
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 6
    stream = client.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}}).text
    events = [json.loads(b[6:]) for b in stream.split("\n\n") if b and b != "data: [DONE]"]
    texts = {0: "", 1: ""}
    for e in events[:-1]:
        texts[e["choices"][0]["index"]] += e["choices"][0]["text"]
    assert texts == {0: TEXT[:3], 1: TEXT[:3]}
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert stream.count("[DONE]") == 1


def test_a_failed_prompt_in_a_list_leaves_nothing_running(make_client):
    from fake_engine import FakeEngine

    engine = FakeEngine()
    client = make_client(engine)
    resp = client.post("/v1/completions", json={"prompt": ["ab", "x" * 300], "max_tokens": 3})
    assert _error(resp, 400)["code"] == "context_length_exceeded"
    assert client.get("/health").status_code == 200
    assert engine.requests == {}  # the first prompt's request was aborted


@pytest.mark.parametrize("stop, limits", [
    ([f"s{i}" for i in range(17)], ServerLimits()),
    ([f"s{i}" for i in range(10_000)], ServerLimits()),
    (["x" * 257], ServerLimits()),
    (["abc"], ServerLimits(max_stop_chars=2)),
    ([""], ServerLimits()),
])
def test_stop_string_limits(make_client, stop, limits):
    resp = make_client(limits=limits).post("/v1/completions", json={"prompt": "x", "stop": stop})
    assert _error(resp, 400)["param"] == "stop"


def test_limits_refuse_nonpositive_values():
    from kvledger.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="--request-timeout-s must be > 0"):
        ServerLimits(request_timeout_s=0)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(make_client):
    stream = make_client().post("/v1/completions", json={
        "prompt": "ab", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).text
    events = [json.loads(b[6:]) for b in stream.split("\n\n") if b and b != "data: [DONE]"]
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 3]
    assert {e["usage"]["prompt_tokens"] for e in events} == {2}
