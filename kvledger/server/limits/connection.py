"""Connection-level guards uvicorn lacks: a header deadline (slowloris) and a header size cap.

uvicorn's HTTP/1.1 protocol (h11) waits for request headers without a deadline (its keep-alive
timer is cancelled by any byte, so a client trickling one header byte at a time holds the
connection for ever) and takes a header block of any size that arrives in one read.
:class:`GuardedH11Protocol` closes a connection whose request headers are not complete
``header_timeout_s`` after the connection opened or the previous response ended, and answers a
header block over ``max_header_bytes`` with 431 and closes. :func:`uvicorn_config` builds the
server config with these guards and the drain's short final grace.
"""

from __future__ import annotations

import asyncio
import json

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvledger.server.limits.server_limits import ServerLimits
from kvledger.server.openai.errors import error_body


def _raw_response(status: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    head = (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a header size cap (class attributes,
    set by :func:`uvicorn_config`)."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 << 10

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._header_bytes, self._tail = 0, b""
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None and self._waiting_for_headers():
            seen = self._tail + data  # the end of headers may straddle two reads
            end = seen.find(b"\r\n\r\n")
            self._header_bytes += (len(seen) if end < 0 else end) - len(self._tail)
            self._tail = seen[-3:]
            if self._header_bytes > self.max_header_bytes:
                self._disarm()
                self.transport.write(_raw_response(
                    "431 Request Header Fields Too Large",
                    f"request headers over {self.max_header_bytes} bytes", "headers_too_large"))
                self.transport.close()
                return
        super().data_received(data)
        if self._header_timer is not None and not self._waiting_for_headers():
            self._disarm()  # a request started: its body has its own deadline

    def _too_slow(self) -> None:
        self._header_timer = None
        if self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()  # no request to answer: the headers never completed

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._disarm()
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def uvicorn_config(app, host: str, port: int, limits: ServerLimits) -> uvicorn.Config:
    """uvicorn's config for ``app`` with the connection guards of ``limits``."""
    protocol = type("GuardedH11", (GuardedH11Protocol,), {
        "header_timeout_s": limits.header_timeout_s,
        "max_header_bytes": limits.max_header_bytes})
    return uvicorn.Config(app, host=host, port=port, log_level="info", http=protocol,
                          h11_max_incomplete_event_size=limits.max_header_bytes,
                          timeout_graceful_shutdown=1)
