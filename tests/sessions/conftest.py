"""Fixtures of the session tests (fakes in :mod:`session_fakes`)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from session_fakes import ChatFakeEngine


@pytest.fixture
def make_app(tmp_path):
    """``make(engine=None, **create_app kwargs) -> TestClient``; closed at teardown."""
    from fastapi.testclient import TestClient

    from kvledger.server.app import create_app

    clients = []

    def make(engine=None, **kwargs):
        client = TestClient(create_app(engine or ChatFakeEngine(), **kwargs))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def served():
    """A uvicorn server of the fake engine's app in a thread; yields (url, app)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import uvicorn

    from kvledger.server.app import create_app

    app = create_app(ChatFakeEngine())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(10)
