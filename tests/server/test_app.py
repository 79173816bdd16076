"""The HTTP surface over a fake engine: shapes, statuses, auth, limits, metrics, logs."""

import json
import logging
import re

import pytest
from fake_engine import KV_BYTES_PER_TOKEN, TEXT, FakeEngine

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def _assert_error(resp, status: int, code=None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^kvledger:{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} missing"
    return float(match.group(1))


def test_models_show_the_context_limit(make_client):
    data = make_client().get("/v1/models").json()["data"]
    assert data == [{"id": "fake-model", "object": "model", "created": data[0]["created"],
                     "owned_by": "kvledger", "max_model_len": FakeEngine.max_model_len}]


def test_chat_non_streamed(make_client):
    body = make_client().post("/v1/chat/completions", json=CHAT).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TEXT[:5]}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5


def test_completion_stream_equals_non_stream(make_client):
    client = make_client()
    req = {"prompt": "abc", "max_tokens": 40}
    whole = client.post("/v1/completions", json=req).json()["choices"][0]
    stream = client.post("/v1/completions", json={**req, "stream": True}).text
    events = [json.loads(b[6:]) for b in stream.split("\n\n") if b and b != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"] == TEXT
    assert events[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "stop"
    assert stream.endswith("data: [DONE]\n\n")


def test_tokenize_text_and_messages(make_client):
    client = make_client()
    assert client.post("/tokenize", json={"prompt": "ab"}).json() == {
        "tokens": [97, 98], "count": 2, "max_model_len": FakeEngine.max_model_len}
    body = client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert body["count"] == len("user: x\nassistant: ")


@pytest.mark.parametrize("payload, status, code", [
    (b"{not json", 400, None),
    (json.dumps({"model": "fake-model"}).encode(), 400, None),
    (json.dumps({**CHAT, "max_tokens": -1}).encode(), 400, None),
    (json.dumps({**CHAT, "model": "gpt-9"}).encode(), 404, "model_not_found"),
    (json.dumps({**CHAT, "max_tokens": 300}).encode(), 400, "context_length_exceeded"),
    (json.dumps({"messages": [{"role": "user", "content": "x" * 300}]}).encode(), 400,
     "context_length_exceeded"),
    (b"[" + b"1," * (5 << 20) + b"1]", 413, "request_too_large"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}', 400, None),
])
def test_bad_chat_requests_get_openai_errors(make_client, payload, status, code):
    resp = make_client().post("/v1/chat/completions", content=payload,
                              headers={"content-type": "application/json"})
    _assert_error(resp, status, code)


def test_validation_error_names_the_field(make_client):
    resp = make_client().post("/v1/chat/completions", json={**CHAT, "max_tokens": -1})
    assert _assert_error(resp, 400)["param"] == "max_tokens"


def test_unknown_route_and_method_keep_their_status(make_client):
    client = make_client()
    _assert_error(client.get("/v1/nothing"), 404)
    _assert_error(client.get("/v1/chat/completions"), 405)


def test_api_key_guards_v1_but_not_health_or_metrics(make_client):
    client = make_client(api_key="sekret")
    _assert_error(client.get("/v1/models"), 401, "invalid_api_key")
    _assert_error(client.post("/v1/chat/completions", json=CHAT,
                              headers={"Authorization": "Bearer wrong"}), 401)
    _assert_error(client.post("/tokenize", json={"prompt": "x"}), 401)
    ok = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    lower = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "bearer sekret"})
    assert lower.status_code == 200  # the scheme is case-insensitive (RFC 9110)
    _assert_error(client.post("/v1/chat/completions", json=CHAT,
                              headers={"Authorization": "Basic sekret"}), 401)
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_full_queue_is_429_with_retry_after(make_client):
    client = make_client(max_queue=0)
    resp = client.post("/v1/chat/completions", json=CHAT)
    _assert_error(resp, 429, "queue_full")
    assert resp.headers["Retry-After"] == "1"


def test_a_request_that_can_never_fit_is_400_not_429(make_client):
    # a 429 would make the openai client retry a request that cannot pass
    client = make_client(FakeEngine(kv_quota_tokens=10))
    resp = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 20})
    assert "23 tokens" in _assert_error(resp, 400, "kv_quota_exceeded")["message"]
    assert "Retry-After" not in resp.headers
    assert _metric(client.get("/metrics").text, "kv_quota_rejections_total") == 1


def test_engine_failure_fails_live_requests_and_keeps_serving(make_client):
    engine = FakeEngine()
    client = make_client(engine)
    engine.fail_next_step = True
    _assert_error(client.post("/v1/chat/completions", json=CHAT), 500, "internal_error")
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert client.get("/health").json() == {"status": "ok"}


def test_scheduler_refusal_is_400_or_one_sse_error_event(make_client):
    # the scheduler fails a request only when it outgrows what the pool can ever hold
    engine = FakeEngine()
    engine.refuse_message = "KV pool too small"
    client = make_client(engine)
    resp = client.post("/v1/chat/completions", json=CHAT)
    assert _assert_error(resp, 400, "kv_quota_exceeded")["message"] == "KV pool too small"
    assert "Retry-After" not in resp.headers
    stream = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert stream.status_code == 200
    events = [json.loads(b[6:]) for b in stream.text.split("\n\n") if b]
    assert events == [{"error": {"message": "KV pool too small",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "kv_quota_exceeded"}}]


def test_metrics_and_logs_per_request(make_client, caplog):
    caplog.set_level(logging.INFO, logger="kvledger.server")
    client = make_client(kv_alert_bytes=10 * KV_BYTES_PER_TOKEN)
    prompt = "abcdef"  # 6 prompt tokens + 5 output tokens = 11 tokens > 10: one alert
    client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5})
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})  # 3 tokens: no alert
    text = client.get("/metrics").text
    assert _metric(text, "request_success_total", 'finished_reason="length"') == 2
    assert _metric(text, "prompt_tokens_total") == 7
    assert _metric(text, "generation_tokens_total") == 7
    assert _metric(text, "kv_alerts_total") == 1
    assert _metric(text, "request_kv_bytes_count") == 2
    assert _metric(text, "request_kv_bytes_sum") == (11 + 3) * KV_BYTES_PER_TOKEN
    assert _metric(text, "time_to_first_token_seconds_count") == 2
    assert _metric(text, "inter_token_latency_seconds_count") == 4 + 1
    assert _metric(text, "num_requests_running") == 0
    assert _metric(text, "kv_blocks_free") == _metric(text, "kv_blocks_total") == 256
    alerts = [r for r in caplog.records if r.getMessage().startswith("kv_alert")]
    assert len(alerts) == 1 and alerts[0].levelno == logging.WARNING
    assert "kv_bytes=1100" in alerts[0].getMessage()
    finished = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("request finished")]
    assert len(finished) == 2
    assert "prompt_tokens=6 output_tokens=5" in finished[0]
    assert "finish_reason=length" in finished[0] and "peak_kv_bytes=1100" in finished[0]


def test_engine_line_is_logged_periodically(make_client, caplog):
    caplog.set_level(logging.INFO, logger="kvledger.server")
    client = make_client(log_interval_s=0.0)
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ")]
    assert lines and "prefix_hit_rate=50.0%" in lines[-1]


def test_openapi_documents_the_openai_error_shape_not_422(make_client):
    spec = make_client().get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "422" not in responses and "4XX" in responses
    assert set(spec["components"]["schemas"]["ErrorDetail"]["properties"]) == {
        "message", "type", "param", "code"}


def test_served_model_name_is_the_one_name_clients_see(make_client):
    client = make_client(served_model_name="my-model")
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["my-model"]
    ok = client.post("/v1/chat/completions", json={**CHAT, "model": "my-model"})
    assert ok.status_code == 200 and ok.json()["model"] == "my-model"
    _assert_error(client.post("/v1/chat/completions", json={**CHAT, "model": "fake-model"}), 404)
    assert 'model_name="my-model"' in client.get("/metrics").text
