"""Faults against a live server (fake engine) on loopback: slowloris, half-sent body, oversized
headers and bodies, a slow reader, injected engine faults, SIGTERM during load."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

import httpx
import pytest
from rel_servers import wait_for

pytestmark = pytest.mark.reliability

STREAM = {"prompt": "x", "ignore_eos": True, "stream": True}


def _recv_all(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def test_slowloris_connections_are_closed_and_others_served(shared_server):
    server = shared_server
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200  # still serving
    start = time.monotonic()
    closed = 0
    for s in socks:  # trickle a header byte now and then, as slowloris does
        try:
            for _ in range(6):
                s.sendall(b"X")
                time.sleep(0.1)
                s.settimeout(0.01)
                try:
                    if s.recv(1) == b"":
                        break
                except TimeoutError:
                    pass
        except OSError:
            pass
    for s in socks:
        if _recv_all(s, 3.0) == b"":
            closed += 1
        s.close()
    assert closed == 20 and time.monotonic() - start < 15


def test_oversized_headers_get_431(shared_server):
    server = shared_server
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-big: " + b"a" * 100_000 + b"\r\n\r\n")
        reply = _recv_all(s, 5.0)
    assert reply.startswith(b"HTTP/1.1 431") and b"headers_too_large" in reply


def test_half_sent_body_gets_408_and_close(shared_server):
    server = shared_server
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\"")
        reply = _recv_all(s, 5.0)
    assert reply.startswith(b"HTTP/1.1 408") and b"connection: close" in reply.lower()


def test_endless_chunked_body_gets_413_and_close(shared_server):
    server = shared_server
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        sent, reply = 0, b""
        s.settimeout(0.01)
        try:
            while sent < 50 << 20:  # 50 MB: the server must answer long before
                s.sendall(b"1000\r\n" + b"a" * 4096 + b"\r\n")
                sent += 4096
                try:
                    reply += s.recv(4096)
                    if reply:
                        break
                except TimeoutError:
                    pass
        except OSError:
            pass  # closed by the server after its 413
        reply += _recv_all(s, 2.0)
    assert reply.startswith(b"HTTP/1.1 413") and sent < 10 << 20


def test_a_slow_reader_is_dropped_and_its_request_aborted(shared_server):
    server = shared_server
    before = server.metrics().get("request_success_total:abort", 0)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", server.port))
    body = json.dumps({**STREAM, "prompt": "big:", "max_tokens": 900_000}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 30  # never read: the server must give up on its own
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get("request_success_total:abort", 0) > before and m["num_requests_running"] == 0:
            break
        time.sleep(0.2)
    s.close()
    m = server.metrics()
    assert m.get("request_success_total:abort", 0) == before + 1
    assert m["num_requests_running"] == 0
    assert "client stopped reading" in server.log_text()


def _stream(url: str, body: dict, results: list, lock: threading.Lock) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as resp:
            text = resp.read().decode()
            outcome = ("done" if text.endswith("data: [DONE]\n\n") else
                       "error-event" if '"error"' in text else f"cut:{text[-80:]!r}")
            if resp.status_code != 200:
                outcome = f"http-{resp.status_code}"
    except httpx.HTTPError as exc:
        outcome = f"transport:{type(exc).__name__}"
    with lock:
        results.append(outcome)


def _run_clients(url: str, bodies: list[dict]) -> list[str]:
    results, lock = [], threading.Lock()
    threads = [threading.Thread(target=_stream, args=(url, b, results, lock)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_injected_engine_faults_fail_requests_cleanly_and_service_goes_on(fake_server):
    server = fake_server("--fail-every", "37", "--step-delay-s", "0.002")
    results = _run_clients(server.url, [{**STREAM, "max_tokens": 20 + i} for i in range(30)])
    assert len(results) == 30
    assert set(results) <= {"done", "error-event"}, results
    assert "error-event" in results  # faults did happen
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert ok.status_code in (200, 500)  # 500 only if a fault hits this one
    log = server.log_text()
    assert log.count("engine step failed") >= 1 and "unhandled error" not in log


def test_sigterm_drains_in_flight_refuses_new_and_exits_0(fake_server):
    server = fake_server("--step-delay-s", "0.02", "drain_timeout_s=10")
    results, lock = [], threading.Lock()
    bodies = [{**STREAM, "max_tokens": 40} for _ in range(8)]  # ~0.8 s each
    threads = [threading.Thread(target=_stream, args=(server.url, b, results, lock))
               for b in bodies]
    for t in threads:
        t.start()
    assert wait_for(server, "num_requests_running", 8)["num_requests_running"] == 8
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    late = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert late.status_code == 503 and late.json()["error"]["code"] == "server_draining"
    for t in threads:
        t.join(30)
    assert results == ["done"] * 8  # every in-flight stream finished
    assert server.proc.wait(20) == 0


def test_sigterm_past_the_drain_timeout_fails_streams_with_an_error_event(fake_server):
    server = fake_server("--step-delay-s", "0.02", "drain_timeout_s=0.5",
                         "--max-model-len", "5000")
    results, lock = [], threading.Lock()
    threads = [threading.Thread(target=_stream, args=(server.url, {**STREAM, "max_tokens": 4000},
                                                      results, lock)) for _ in range(4)]
    for t in threads:
        t.start()
    assert wait_for(server, "num_requests_running", 4)["num_requests_running"] == 4
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert results == ["error-event"] * 4, results
    assert server.proc.wait(20) == 0
    assert "drain timeout" in server.log_text()


def test_async_clients_disconnecting_early_leave_nothing_running(shared_server):
    server = shared_server
    before = server.metrics()

    async def client(i: int) -> str:
        async with httpx.AsyncClient(timeout=30) as c:
            body = {**STREAM, "max_tokens": 20_000 if i % 2 else 60}
            async with c.stream("POST", server.url + "/v1/completions", json=body) as resp:
                n = 0
                async for _ in resp.aiter_lines():
                    n += 1
                    if i % 2 and n > 5:
                        return "left"
            return "done"

    async def run():
        return await asyncio.gather(*(client(i) for i in range(40)))

    outcomes = asyncio.run(run())
    assert outcomes.count("left") == 20 and outcomes.count("done") == 20
    m = wait_for(server, "num_requests_running", 0)
    assert m["num_requests_running"] == 0 and m["kv_bytes_allocated"] == 0
    assert m["kv_blocks_free"] == m["kv_blocks_total"]  # no block leaked
    for reason in ("abort", "length"):  # every request accounted for: none lost
        key = f"request_success_total:{reason}"
        assert m.get(key, 0) - before.get(key, 0) == 20, reason
