"""Graceful drain: on SIGTERM stop taking work, let in-flight requests finish, then exit 0.

:class:`DrainMiddleware` counts the HTTP requests in flight and, once :attr:`Drain.draining`
is set, answers every new one except ``/health`` and ``/metrics`` with 503 (and ``/health``
itself says the server is draining). :class:`DrainingServer` is uvicorn's server with its exit
handler changed: the first SIGTERM or SIGINT starts the drain; uvicorn is told to exit when no
request is in flight or ``drain_timeout_s`` has passed, whichever is first. At the timeout
the engine thread is stopped first, which ends every request still running with a clear error
(503 ``server_draining``, or one SSE error event) instead of a cut connection. A second signal exits at once, as uvicorn does. The process exits with code 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from kvledger.server.openai.error_handlers import error_response

log = logging.getLogger("kvledger.server")

ALWAYS_OPEN = frozenset({"/health", "/metrics"})
POLL_S = 0.05


@dataclass
class Drain:
    """Drain state shared by the middleware, the routes and the server."""

    draining: bool = False
    in_flight: int = 0


class DrainMiddleware:
    """Count requests in flight; while draining, refuse new ones with 503."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ALWAYS_OPEN:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            response = error_response(503, "the server is shutting down; retry on another "
                                      "instance or later", "server_draining",
                                      headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining on the first SIGTERM/SIGINT (module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_timeout_s: float,
                 stop_engine: Callable[[], None]) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_timeout_s = drain_timeout_s
        self.stop_engine = stop_engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining:  # second signal: exit now
            self.force_exit = True
            self.should_exit = True
            return
        self.drain.draining = True
        log.info("signal %d: draining %d in-flight requests (at most %g s)", sig,
                 self.drain.in_flight, self.drain_timeout_s)
        threading.Thread(target=self._exit_when_drained, name="kvledger-drain",
                         daemon=True).start()

    def _exit_when_drained(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.drain.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if self.drain.in_flight:
            log.warning("drain timeout: failing %d requests still in flight",
                        self.drain.in_flight)
            self.stop_engine()
            deadline = time.monotonic() + 1.0
            while self.drain.in_flight > 0 and time.monotonic() < deadline:
                time.sleep(POLL_S)
        else:
            log.info("drained; shutting down")
        self.should_exit = True
