"""The state DB under faults while serving: another process holding it locked, and shutdown.

A lock held past the busy timeout is load that passes: HTTP 503 with Retry-After (a
``response.failed`` event when streaming), the turn not stored, the conversation released, and
every other route served meanwhile. At shutdown the store is closed, so SQLite checkpoints its
write-ahead log into the file and removes it (https://www.sqlite.org/wal.html: "when the last
connection to a database closes, that connection does a checkpoint and then deletes the WAL").
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from session_fakes import ChatFakeEngine

import kvledger.sessions.store as store_module
from kvledger.server.app import create_app
from kvledger.sessions.service import SessionOptions

HOLD_LOCK = ("import sqlite3, sys; db = sqlite3.connect(sys.argv[1], isolation_level=None); "
             "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); sys.stdin.read()")
TURN = {"model": "fake-model", "input": "hi"}


@pytest.fixture
def locker(tmp_path):
    """``lock(db)``: another process takes an exclusive lock on ``db`` until teardown."""
    procs = []

    def lock(db: Path) -> None:
        proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(db)], text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"

    yield lock
    for proc in procs:
        proc.stdin.close()
        proc.wait(10)


def test_a_db_locked_by_another_process_is_a_503_and_nothing_else_breaks(
        tmp_path, monkeypatch, locker):
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_MS", 300)
    db = tmp_path / "state.db"
    app = create_app(ChatFakeEngine(), sessions=SessionOptions(state_db=str(db)))
    with TestClient(app, raise_server_exceptions=False) as client:
        first = client.post("/v1/responses", json=TURN)
        assert first.status_code == 200
        locker(db)
        refused = client.post("/v1/responses", json={**TURN, "previous_response_id":
                                                     first.json()["id"]})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        error = refused.json()["error"]
        assert error["code"] == "state_db_unavailable" and "locked by another process" in (
            error["message"])
        with client.stream("POST", "/v1/responses", json={**TURN, "stream": True}) as stream:
            events = "".join(stream.iter_text())
        assert "response.failed" in events and "state_db_unavailable" in events
        chat = client.post("/v1/chat/completions", json={
            "model": "fake-model", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 3})
        assert chat.status_code == 200


def test_the_conversation_continues_once_the_lock_is_gone(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_MS", 300)
    db = tmp_path / "state.db"
    app = create_app(ChatFakeEngine(), sessions=SessionOptions(state_db=str(db)))
    with TestClient(app, raise_server_exceptions=False) as client:
        first = client.post("/v1/responses", json=TURN).json()["id"]
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")
        follow = {**TURN, "previous_response_id": first}
        assert client.post("/v1/responses", json=follow).status_code == 503
        other.execute("ROLLBACK")
        other.close()
        again = client.post("/v1/responses", json=follow)  # released: not a 409
        assert again.status_code == 200, again.text
        assert client.get(f"/v1/responses/{again.json()['id']}").status_code == 200


def test_shutdown_checkpoints_the_state_db(tmp_path):
    db = tmp_path / "state.db"
    app = create_app(ChatFakeEngine(), sessions=SessionOptions(state_db=str(db)))
    with TestClient(app) as client:
        stored = client.post("/v1/responses", json=TURN).json()["id"]
        assert Path(f"{db}-wal").exists()  # WAL mode: the row is in the log, not yet the file
    assert not Path(f"{db}-wal").exists()
    row = sqlite3.connect(db).execute("SELECT id FROM responses").fetchone()
    assert row == (stored,)
