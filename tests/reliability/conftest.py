"""Servers for the reliability suite: the fake engine (fast), each a process on a free
loopback port; their logs are kept for the 'no traceback' checks (helpers in rel_servers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rel_servers import SHARED_ARGS, FakeServerProcess


@pytest.fixture(scope="package")
def shared_server(tmp_path_factory):
    """One fake-engine server for the tests that do not stop or break it (SHARED_ARGS)."""
    server = FakeServerProcess(tmp_path_factory.mktemp("shared") / "server.log", *SHARED_ARGS)
    yield server
    server.close()


@pytest.fixture
def fake_server(tmp_path):
    """Factory: ``fake_server(*args)`` starts serve_fake.py with those arguments."""
    servers = []

    def start(*args: str) -> FakeServerProcess:
        server = FakeServerProcess(tmp_path / f"server{len(servers)}.log", *args)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()
