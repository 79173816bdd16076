"""Fixtures of the server tests: apps around the fake engine (fast) and a live server."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from live_server import LiveServer


@pytest.fixture
def make_client(app_client):
    """``make(engine=None, **create_app kwargs)``: a TestClient, FakeEngine by default."""
    return lambda engine=None, **kwargs: app_client(engine or FakeEngine(), **kwargs)


@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    """One ``kvledger serve`` subprocess (bundled model) shared by the live tests."""
    server = LiveServer(tmp_path_factory.mktemp("serve") / "server.log")
    yield server
    server.close()
