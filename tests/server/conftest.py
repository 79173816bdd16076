"""Fixtures of the server tests: apps around the fake engine (fast) and a live server."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from live_server import LiveServer


@pytest.fixture
def make_client():
    """Build a TestClient around create_app(engine, **kwargs); closes them at teardown."""
    from fastapi.testclient import TestClient

    from kvledger.server.app import create_app

    clients = []

    def make(engine: FakeEngine | None = None, **kwargs) -> TestClient:
        client = TestClient(create_app(engine or FakeEngine(), **kwargs))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture(scope="session")
def live_server(tmp_path_factory):
    """One ``kvledger serve`` subprocess (bundled model) shared by the live tests."""
    server = LiveServer(tmp_path_factory.mktemp("serve") / "server.log")
    yield server
    server.close()
