"""Hostile input against a live keyed server (fake engine): every malformed body answered 4xx,
never 5xx, no traceback in the log; wrong or missing keys; bounded schemathesis fuzzing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from rel_servers import FakeServerProcess

pytestmark = pytest.mark.reliability

KEY = "rel-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {**AUTH, "content-type": "application/json"}
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize")


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    server = FakeServerProcess(tmp_path_factory.mktemp("keyed") / "server.log",
                               "--api-key", KEY)
    yield server
    server.close()


GENERATION = ROUTES[:2]


def _input(route: str, value: str) -> str:
    """The route's input field holding the JSON text ``value``."""
    if route == "/v1/chat/completions":
        return f'"messages": [{{"role": "user", "content": {value}}}]'
    return f'"prompt": {value}'


def _cases() -> list[tuple[str, tuple[str, ...], object]]:
    """(what, routes, body maker): the maker turns a route into the raw body sent to it."""
    huge_digits = "9" * 5000  # past Python's int-parsing digit limit
    deep = "[" * 100_000 + "]" * 100_000

    def field(extra: str):
        return lambda r: ("{" + _input(r, '"x"') + ", " + extra + "}").encode()

    def bad_input(value: bytes | str):
        raw = value if isinstance(value, bytes) else value.encode()
        return lambda r: b"{" + _input(r, "VALUE").encode().replace(b"VALUE", raw) + b"}"

    stops = json.dumps([f"s{i}" for i in range(10_000)])
    return [
        ("invalid UTF-8", ROUTES, bad_input(b'"\xff\xfe\xfd"')),
        ("lone surrogate", ROUTES, bad_input('"\\ud800"')),
        ("deep nesting in the input", ROUTES, bad_input(deep)),
        ("an object as the input", ROUTES, bad_input('{"a": 1}')),
        ("huge int max_tokens", GENERATION, field(f'"max_tokens": {huge_digits}')),
        ("1e30 max_tokens", GENERATION, field(f'"max_tokens": {10**30}')),
        ("seed 2**64", GENERATION, field(f'"seed": {2**64}')),
        ("NaN temperature", GENERATION, field('"temperature": NaN')),
        ("Infinity top_p", GENERATION, field('"top_p": Infinity')),
        ("-Infinity logit_bias", GENERATION, field('"logit_bias": {"1": -Infinity}')),
        ("logit_bias out of range", GENERATION, field('"logit_bias": {"5": 1000}')),
        ("10,000 stop strings", GENERATION, field(f'"stop": {stops}')),
        ("stream 'yes'", GENERATION, field('"stream": "yes"')),
        ("unsupported field", GENERATION, field('"tools": [{"type": "function"}]')),
        ("top_logprobs 21", ("/v1/chat/completions",), field('"logprobs": true, '
                                                             '"top_logprobs": 21')),
        ("logprobs 21", ("/v1/completions",), field('"logprobs": 21')),
        ("deep nesting", ROUTES, lambda r: deep.encode()),
        ("null body", ROUTES, lambda r: b"null"),
        ("list body", ROUTES, lambda r: b"[1, 2]"),
        ("string body", ROUTES, lambda r: b'"hello"'),
        ("empty body", ROUTES, lambda r: b""),
        ("truncated JSON", ROUTES, lambda r: b'{"prompt": "x", "max_tok'),
    ]


def test_hostile_bodies_get_4xx_never_5xx(keyed_server):
    statuses: Counter = Counter()
    with httpx.Client(base_url=keyed_server.url, timeout=30) as client:
        for what, routes, make in _cases():
            for route in routes:
                resp = client.post(route, content=make(route), headers=JSON)
                statuses[route, resp.status_code // 100] += 1
                assert 400 <= resp.status_code < 500, (what, route, resp.text[:300])
                err = resp.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, (what, route)
        assert client.get("/health").status_code == 200
    print("hostile bodies:", dict(statuses))
    log = keyed_server.log_text()
    assert "Traceback" not in log and "unhandled error" not in log


def test_wrong_or_missing_key_on_every_route(keyed_server):
    spec = httpx.get(keyed_server.url + "/openapi.json").json()["paths"]
    open_paths = {"/health", "/metrics"}
    checked = 0
    for path, methods in spec.items():
        url = keyed_server.url + path.replace("{model_id}", "fake-model")
        for method in methods:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                resp = httpx.request(method.upper(), url, headers=headers, timeout=10)
                if path in open_paths:
                    assert resp.status_code == 200, path
                else:
                    assert resp.status_code == 401, (path, headers)
                    assert resp.json()["error"]["code"] == "invalid_api_key"
                checked += 1
    assert checked >= 3 * 6


def test_schemathesis_bounded_fuzz_finds_no_server_error(keyed_server, tmp_path):
    cmd = [str(Path(sys.executable).parent / "schemathesis"), "run",
           keyed_server.url + "/openapi.json", "-H", f"Authorization: Bearer {KEY}",
           "--checks", "not_a_server_error", "--phases", "examples,fuzzing", "-n", "25",
           "--max-time", "45", "--seed", "11", "--request-timeout", "30", "--no-shrink"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                         check=False)
    print(run.stdout[-1200:])
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    generated = re.search(r"(\d+) generated", run.stdout)
    assert generated and int(generated.group(1)) >= 25, run.stdout[-2000:]
    log = keyed_server.log_text()
    assert "Traceback" not in log and "unhandled error" not in log


def test_pipelined_requests_all_get_an_answer(keyed_server):
    import socket

    body = b'{"prompt": "hi", "max_tokens": 2}'
    one = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
           + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
           % (len(body), body))
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", keyed_server.port), timeout=10) as s:
        s.sendall(one + health + one + health + one)
        data, deadline = b"", time.monotonic() + 10
        while data.count(b"HTTP/1.1 ") < 5 and time.monotonic() < deadline:
            data += s.recv(65536)
    assert data.count(b"HTTP/1.1 200") == 5, data[-500:]
