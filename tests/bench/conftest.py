"""Fixtures of the bench tests: the scripted SSE server (see fake_sse.py)."""

from __future__ import annotations

import pytest
from fake_sse import FakeServer


@pytest.fixture(scope="module")
def fake_server():
    """A scripted server without /metrics or /tokenize, on 127.0.0.1 and an ephemeral port."""
    with FakeServer() as server:
        yield server
