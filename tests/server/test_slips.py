"""Issue 43's smaller slips: HEAD /health, bodies without a JSON content type, an empty body,
escaped unknown field names, and a timed-out request answered 504 without Retry-After."""

from __future__ import annotations

import logging

from fake_engine import FakeEngine

from kvledger.server.limits.server_limits import ServerLimits

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_head_health_answers_like_get(make_client):
    r = make_client().head("/health")
    assert r.status_code == 200 and r.content == b""


def test_a_json_body_sent_as_form_data_or_without_a_type_is_read_as_json(make_client):
    client = make_client()
    for content_type in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"content-type": content_type} if content_type else {}
        r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", '
                        b'"content": "hi"}], "max_tokens": 2}', headers=headers)
        assert r.status_code == 200, (content_type, r.text)
    r = client.post("/v1/chat/completions", content=b"messages=hi",
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_an_empty_body_says_so(make_client):
    r = make_client().post("/v1/completions", content=b"",
                           headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "The request body is empty; send a JSON object."


def test_unknown_field_names_are_escaped_in_the_log(make_client, caplog):
    caplog.set_level(logging.WARNING, logger="kvledger.server")
    forged = "x\n2026-01-01 INFO kvledger.server: admin logged in"
    assert make_client().post("/v1/chat/completions", json={**CHAT, forged: 1}).status_code == 200
    [line] = [r.getMessage() for r in caplog.records if "unknown request" in r.getMessage()]
    assert "\n" not in line and "x\\n2026-01-01" in line


def test_a_request_timeout_is_504_without_retry_after(make_client):
    client = make_client(FakeEngine(step_delay_s=0.05),
                         limits=ServerLimits(request_timeout_s=0.2))
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 200,
                                             "ignore_eos": True})
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    assert "Retry-After" not in r.headers
