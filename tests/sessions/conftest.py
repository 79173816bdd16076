"""Fixtures of the session tests (fakes in :mod:`session_fakes`)."""

from __future__ import annotations

import threading
import time

import pytest
from serve_process import free_port
from session_fakes import ChatFakeEngine


@pytest.fixture
def make_app(app_client):
    """``make(engine=None, **create_app kwargs) -> TestClient``, ChatFakeEngine by default."""
    return lambda engine=None, **kwargs: app_client(engine or ChatFakeEngine(), **kwargs)


@pytest.fixture
def served():
    """A uvicorn server of the fake engine's app in a thread; yields (url, app)."""
    port = free_port()
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
