"""Limits and failure paths over the fake engine: body limits, key before body, the key table,
request timeout, stream slots, slow readers, a dead engine thread, the drain gate."""

import asyncio
import json

import pytest
from fake_engine import FakeEngine

from kvledger.server.limits.body import MAX_JSON_DEPTH, BodyLimitMiddleware
from kvledger.server.limits.server_limits import ServerLimits
from kvledger.server.openai.streaming import EngineStream

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
KEY = {"Authorization": "Bearer sekret"}


def _error(resp, status: int, code=None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    if code is not None:
        assert err["code"] == code
    return err


def test_the_key_is_checked_before_the_body_is_read(make_client):
    client = make_client(api_key="sekret")
    huge = b"[" + b"1," * (5 << 20) + b"1]"  # over the 4 MiB body limit
    resp = client.post("/v1/completions", content=huge,
                       headers={"content-type": "application/json"})
    _error(resp, 401, "invalid_api_key")  # before: 413 after reading all of it


def test_json_nested_past_the_limit_is_refused_naming_it(make_client):
    """Old code: 1,000 levels got 400 "There was an error parsing the body", no limit named."""
    client = make_client()

    def body(levels: int, prompt: str = "x") -> str:  # the object itself is one more level
        return json.dumps({"prompt": prompt, "max_tokens": 2})[:-1] + (
            f', "extra": {"[" * levels}{"]" * levels}}}')

    err = _error(client.post("/v1/completions", content=body(1000)), 400, "json_too_deep")
    assert err["message"] == ("the request body's JSON nests arrays and objects 1001 levels "
                              f"deep; the limit is {MAX_JSON_DEPTH} levels")
    _error(client.post("/v1/completions", content=body(MAX_JSON_DEPTH)), 400, "json_too_deep")
    assert client.post("/v1/completions", content=body(MAX_JSON_DEPTH - 1)).status_code == 200
    in_strings = body(MAX_JSON_DEPTH - 1, '\\"[{' * 50 + "]")  # brackets in a string
    resp = client.post("/v1/completions", content=in_strings)
    assert resp.status_code == 200, resp.text


# Every route and whether it needs the key (README "Which routes need the key").
OPEN = {"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def test_every_route_with_and_without_the_key(make_client):
    client = make_client(api_key="sekret")
    schema = client.get("/openapi.json").json()["paths"]
    routes = [(p, m.upper()) for p, methods in schema.items() for m in methods]
    routes += [("/docs", "GET"), ("/redoc", "GET"), ("/openapi.json", "GET")]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= {
        p for p, _ in routes}
    for path, method in routes:
        url = path.replace("{model_id:path}", "fake-model")
        without = client.request(method, url)
        wrong = client.request(method, url, headers={"Authorization": "Bearer nope"})
        with_key = client.request(method, url, headers=KEY)
        if path in OPEN:
            assert without.status_code != 401 and wrong.status_code != 401, path
        else:
            assert without.status_code == wrong.status_code == 401, path
            assert with_key.status_code != 401, path
    _error(client.get("/v1/no-such-route"), 401)  # default deny, also for unknown routes


async def _run_middleware(receive_messages, max_bytes=10, timeout_s=5.0, drain_s=0.5):
    """Drive BodyLimitMiddleware with a scripted receive; return (status, headers, reads)."""
    reads, sent = [0], []

    async def receive():
        reads[0] += 1
        return await receive_messages()

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):  # pragma: no cover - must not be reached
        raise AssertionError("the app saw an over-limit body")

    mw = BodyLimitMiddleware(app, max_bytes=max_bytes, timeout_s=timeout_s, drain_s=drain_s)
    scope = {"type": "http", "headers": [], "method": "POST", "path": "/v1/completions"}
    await asyncio.wait_for(mw(scope, receive, send), 10)
    start = sent[0]
    return start["status"], dict(start["headers"]), reads[0]


def test_an_endless_chunked_body_is_cut_off_and_the_connection_closed():
    async def endless():
        return {"type": "http.request", "body": b"x" * 4, "more_body": True}

    status, headers, reads = asyncio.run(_run_middleware(endless))
    assert status == 413 and headers[b"connection"] == b"close"
    assert reads <= 2 * 10 // 4 + 2  # at most max_bytes more were drained


def test_a_trickling_body_is_cut_off_by_the_drain_time():
    async def slow():
        await asyncio.sleep(0.05)
        return {"type": "http.request", "body": b"x", "more_body": True}

    status, _, reads = asyncio.run(_run_middleware(slow, max_bytes=1000, timeout_s=0.3))
    assert status == 408 and reads < 20


def test_a_half_sent_body_gets_408():
    async def never():
        await asyncio.sleep(3600)

    status, headers, _ = asyncio.run(_run_middleware(never, timeout_s=0.2))
    assert status == 408 and headers[b"connection"] == b"close"


def test_request_timeout_aborts_and_answers(make_client):
    engine = FakeEngine(step_delay_s=0.02)
    client = make_client(engine, limits=ServerLimits(request_timeout_s=0.2))
    body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
    resp = client.post("/v1/completions", json=body)
    _error(resp, 504, "request_timeout")
    stream = client.post("/v1/completions", json={**body, "stream": True}).text
    last = json.loads(stream.strip().split("\n\n")[-1][6:])
    assert last["error"]["code"] == "request_timeout"
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert len(engine.aborted) == 2 and engine.requests == {}


def test_stream_slots_are_capped_and_released(make_client):
    engine = FakeEngine(step_delay_s=0.02)
    client = make_client(engine, limits=ServerLimits(max_concurrent_streams=1))
    body = {"prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as first:
        assert first.status_code == 200
        _error(client.post("/v1/completions", json=body), 429, "too_many_streams")
        assert client.post("/v1/completions", json={**body, "stream": False}).status_code == 200
    assert client.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
    assert client.app.state.server.streams == 0


def test_a_client_that_stops_reading_is_dropped_and_its_request_aborted():
    closed = []

    async def scenario():
        async def events():
            for _ in range(1000):
                yield "data: x\n\n"

        async def send(message):  # the client's socket buffer is full: writes never complete
            if message["type"] == "http.response.body":
                await asyncio.sleep(3600)

        async def receive():
            await asyncio.sleep(3600)

        stream = EngineStream(events(), lambda: closed.append(True), send_timeout_s=0.1)
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        await asyncio.wait_for(stream(scope, receive, send), 5)

    asyncio.run(scenario())
    assert closed == [True]


class Fatal(BaseException):
    """Escapes the engine loop's ``except Exception``: the engine thread dies."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_after_the_engine_thread_dies_requests_get_503_at_once(make_client):
    engine = FakeEngine(step_delay_s=0.01)
    client = make_client(engine)
    real_step = engine.step

    def dying_step():
        if engine.requests:
            raise Fatal()
        return real_step()

    engine.step = dying_step
    # the request in flight when the thread dies gets an error, not a hang
    _error(client.post("/v1/completions", json={"prompt": "x"}), 500, "internal_error")
    _error(client.post("/v1/completions", json={"prompt": "x"}), 503, "engine_unavailable")
    _error(client.post("/tokenize", json={"prompt": "x"}), 503, "engine_unavailable")
    _error(client.get("/health"), 503, "engine_unavailable")


def test_calls_after_stop_resolve_at_once():
    from kvledger.server.engine_loop import EngineLoop, EngineUnavailableError
    from kvledger.server.metrics.observer import RequestObserver
    from kvledger.server.metrics.server_metrics import ServerMetrics

    async def scenario():
        loop = EngineLoop(FakeEngine(), RequestObserver(ServerMetrics("fake-model")))
        loop.start()
        assert await loop.call(lambda e: 7) == 7
        loop.stop()
        with pytest.raises(EngineUnavailableError):
            await asyncio.wait_for(loop.call(lambda e: 7), 2)  # before: never resolved

    asyncio.run(scenario())


def test_draining_refuses_new_requests_but_not_health_or_metrics(make_client):
    client = make_client()
    client.app.state.server.drain.draining = True
    resp = client.post("/v1/chat/completions", json=CHAT)
    _error(resp, 503, "server_draining")
    assert resp.headers["Retry-After"] == "1"
    _error(client.get("/health"), 503, "server_draining")
    assert client.get("/metrics").status_code == 200
