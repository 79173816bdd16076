"""A scripted OpenAI-style SSE server for the bench tests (stdlib http.server, one thread).

The ``model`` field of a request picks the script, so one server serves every case:

- ``role-pause``: a role-only first chunk, 300 ms of silence, then 4 one-token chunks;
- ``done-only``: nothing but ``data: [DONE]`` (a failure: no content);
- ``multi-token``: 3 chunks of 2 tokens each, 100 ms apart, usage says 6 tokens;
- ``split``: ``: keep-alive`` comments, CRLF line ends, and one JSON event written in two TCP
  writes 50 ms apart;
- ``no-usage``: 3 one-token chunks and no usage chunk;
- ``late-done``: 2 one-token chunks, then 300 ms of silence before the usage and ``[DONE]``;
- ``continuous-usage``: usage in every chunk (vLLM's ``continuous_usage_stats``): a first
  content chunk that brings 3 tokens (two made no text of their own), then 3 one-token chunks
  50 ms apart;
- ``http-500``: an HTTP 500 error;
- anything else (``steady``): role chunk, then ``max_tokens`` one-token chunks 2 ms apart, with
  TTFT growing with the prompt (1 ms per 100 characters), and a usage chunk (prompt tokens:
  characters / 4, or words when /tokenize is on, matching that tokenizer).

``/v1/models`` lists ``steady``. ``/metrics`` answers 404 unless the server is built with
``metrics_text``; ``/tokenize`` answers 404 unless built with ``tokenize="llama.cpp"``: then, as llama.cpp's
server does, it takes ``{"content"}`` (one token per word) and answers a body without
``content`` (vLLM's ``{"prompt"}``) with ``{"tokens": []}``. With ``api_key`` every route needs
``Authorization: Bearer <key>`` (else 401). Responses are HTTP/1.0 (body ends when the
connection closes).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


def _chunk(body: dict) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


def _content(chat: bool, text: str) -> dict:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"id": "x", "object": "chunk", "choices": [choice]}


def _usage(prompt: int, completion: int) -> bytes:
    return _chunk({"id": "x", "choices": [],
                   "usage": {"prompt_tokens": prompt, "completion_tokens": completion}})


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    metrics_text: str | None = None
    tokenize: str | None = None
    api_key: str | None = None
    max_model_len: int | None = None

    def log_message(self, *args) -> None:  # keep test output quiet
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.api_key and self.headers.get("Authorization") != f"Bearer {self.api_key}":
            self._json(401, {"error": {"message": "bad key"}})
            return False
        return True

    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/v1/models":
            card = {"id": "steady", "object": "model"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len
            self._json(200, {"object": "list", "data": [card]})
        elif self.path == "/metrics" and self.metrics_text is not None:
            data = self.metrics_text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self._authorized():
            return
        if self.path == "/tokenize" and self.tokenize == "llama.cpp":
            self._json(200, {"tokens": list(range(len(body.get("content", "").split())))})
            return
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, {"error": "not found"})
            return
        script = body.get("model", "steady")
        if script == "http-500":
            self._json(500, {"error": {"message": "boom"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = self.path == "/v1/chat/completions"
        getattr(self, "_" + script.replace("-", "_"), self._steady)(body, chat)

    def _send(self, data: bytes, pause: float = 0.0) -> None:
        self.wfile.write(data)
        self.wfile.flush()
        if pause:
            time.sleep(pause)

    def _role(self, chat: bool) -> None:
        if chat:
            self._send(_chunk({"id": "x", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}}]}))

    def _role_pause(self, body: dict, chat: bool) -> None:
        self._role(chat)
        time.sleep(0.3)
        for word in ("Hello", " there", " dear", " user"):
            self._send(_chunk(_content(chat, word)), 0.02)
        self._send(_usage(7, 4) + b"data: [DONE]\n\n")

    def _done_only(self, body: dict, chat: bool) -> None:
        self._send(b"data: [DONE]\n\n")

    def _multi_token(self, body: dict, chat: bool) -> None:
        self._role(chat)
        for i, pair in enumerate(("a b", " c d", " e f")):
            self._send(_chunk(_content(chat, pair)), 0.1 if i < 2 else 0.0)
        self._send(_usage(5, 6) + b"data: [DONE]\n\n")

    def _split(self, body: dict, chat: bool) -> None:
        self._send(b": keep-alive\r\n\r\n", 0.02)
        event = _chunk(_content(chat, "split")).replace(b"\n", b"\r\n")
        self._send(event[:17], 0.05)  # half a JSON object in one TCP write ...
        self._send(event[17:] + b": ping\r\n\r\n", 0.02)  # ... the rest in the next
        self._send(_chunk(_content(chat, " ok")) + b":\n\n" + _chunk(_content(chat, "!")))
        self._send(_usage(3, 3) + b"data: [DONE]\r\n\r\n")

    def _no_usage(self, body: dict, chat: bool) -> None:
        for word in ("x", "y", "z"):
            self._send(_chunk(_content(chat, word)), 0.01)
        self._send(b"data: [DONE]\n\n")

    def _late_done(self, body: dict, chat: bool) -> None:
        for word in ("x", "y"):
            self._send(_chunk(_content(chat, word)), 0.01)
        time.sleep(0.3)
        self._send(_usage(3, 2) + b"data: [DONE]\n\n")

    def _continuous_usage(self, body: dict, chat: bool) -> None:
        self._role(chat)
        for i, word in enumerate(("abc", "d", "e", "f")):
            event = {**_content(chat, word),
                     "usage": {"prompt_tokens": 3, "completion_tokens": 3 + i}}
            self._send(_chunk(event), 0.05)
        self._send(_usage(3, 6) + b"data: [DONE]\n\n")

    def _steady(self, body: dict, chat: bool) -> None:
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        self._role(chat)
        time.sleep(len(prompt) / 100_000)
        n = body.get("max_tokens", 8)
        for _ in range(n):
            self._send(_chunk(_content(chat, " tok")), 0.002)
        used = len(prompt.split()) if self.tokenize else len(prompt) // 4
        self._send(_usage(used, n) + b"data: [DONE]\n\n")


class FakeServer:
    """Runs the scripted server on 127.0.0.1 with an ephemeral port in a daemon thread."""

    def __init__(self, metrics_text: str | None = None, tokenize: str | None = None,
                 api_key: str | None = None, max_model_len: int | None = None) -> None:
        handler = type("Handler", (_Handler,), {
            "metrics_text": metrics_text, "tokenize": tokenize, "api_key": api_key,
            "max_model_len": max_model_len})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
