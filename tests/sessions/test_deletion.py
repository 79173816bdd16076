"""Deleting a response deletes its data; expiry by age and size; a per-key quota.

"Deleted" is checked in the bytes on disk: the document's text must be in neither the SQLite
file nor its write-ahead log after ``DELETE /v1/responses/{id}``, and the file shrinks back.
"""

from __future__ import annotations

import base64
import sqlite3
import time

import pytest
from session_fakes import ChatFakeEngine

from kvledger.sessions.expiry import check_quota, expire
from kvledger.sessions.service import SessionOptions
from kvledger.sessions.store import SessionStore, StoredResponse

MARKER = b"ZEBRA-7731-QUARTZ"
DOCUMENT = b" ".join(MARKER + b" line %d of the secret report." % i for i in range(6000))


def _doc_turn(client, store: bool = True, key: str | None = None,
              text: str = "Summarise."):
    part = {"type": "input_file", "filename": "report.txt",
            "file_data": base64.b64encode(DOCUMENT).decode()}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post("/v1/responses", headers=headers, json={
        "input": [{"role": "user", "content": [{"type": "input_text", "text": text},
                                               part]}],
        "max_output_tokens": 4, "store": store})


def _on_disk(path) -> bytes:
    return b"".join(p.read_bytes() for p in (path, path.with_name(path.name + "-wal"))
                    if p.exists())


def test_delete_removes_the_documents_text_from_the_file(make_app, tmp_path):
    path = tmp_path / "state.db"
    client = make_app(sessions=SessionOptions(state_db=str(path)))
    store = client.app.state.sessions.store
    empty = store.used_bytes()
    r = _doc_turn(client)
    assert r.status_code == 200, r.text
    assert MARKER in _on_disk(path) and store.used_bytes() > empty + len(DOCUMENT)
    assert client.delete(f"/v1/responses/{r.json()['id']}").status_code == 200
    assert MARKER not in _on_disk(path)
    assert store.chunks("", r.json()["id"]) == []
    assert store.used_bytes() < empty + len(DOCUMENT) // 10
    assert path.stat().st_size < empty + len(DOCUMENT) // 10  # the pages went back


def test_a_turn_that_is_not_stored_keeps_no_document(make_app, tmp_path):
    path = tmp_path / "state.db"
    client = make_app(ChatFakeEngine(max_model_len=600),
                      sessions=SessionOptions(state_db=str(path)))
    r = _doc_turn(client, text="What does the secret report say about ZEBRA-7731-QUARTZ?")
    # the retrieved passages do not fit the 600-token context: refused after stitching
    assert r.status_code == 400, r.text
    assert MARKER not in _on_disk(path)


def _put(store: SessionStore, tenant: str, session: str, created_at: float,
         size: int = 1000) -> None:
    store.put_response(StoredResponse(session, tenant, session, None, {"t": "x" * size}, {},
                                      [1, 2, 3], 2, created_at))


def test_expiry_by_age_removes_the_old_conversations_only(tmp_path):
    store = SessionStore(tmp_path / "s.db")
    now = time.time()
    for i, age in enumerate((100, 5000, 10)):
        _put(store, "t", f"c{i}", now - age)
    assert expire(store, 3600, None, now) == {"age": 1, "size": 0}
    assert [s.session_id for s in store.sessions("t")] == ["c2", "c0"]


def test_expiry_by_size_removes_the_least_recent_first(tmp_path):
    store = SessionStore(tmp_path / "s.db")
    now = time.time()
    for i in range(40):
        _put(store, "t", f"c{i:02d}", now - 1000 + i, size=20_000)
    limit = store.used_bytes() // 2
    removed = expire(store, None, limit, now)
    left = sorted(s.session_id for s in store.sessions("t"))
    assert removed["size"] == 40 - len(left) and store.used_bytes() <= limit
    assert left == [f"c{i:02d}" for i in range(40 - len(left), 40)]  # the newest stay


def test_expiry_is_counted_in_the_metrics(make_app, tmp_path):
    path = tmp_path / "state.db"
    _put(SessionStore(path), "", "old", time.time() - 10_000)
    client = make_app(sessions=SessionOptions(state_db=str(path), max_age_s=3600))
    assert 'session_conversations_removed_total{model_name="fake-model",reason="age"} 1.0' \
        in client.get("/metrics").text


def test_a_key_at_its_quota_gets_403_for_stored_turns_only(make_app):
    client = make_app(api_key=["a", "b"], sessions=SessionOptions(quota_bytes=50_000))
    assert _doc_turn(client, key="a").status_code == 200
    over = _doc_turn(client, key="a")
    assert over.status_code == 403 and over.json()["error"]["code"] == "state_quota_exceeded"
    assert "Retry-After" not in over.headers
    assert _doc_turn(client, store=False, key="a").status_code == 200
    assert _doc_turn(client, key="b").status_code == 200


def test_quota_counts_only_the_tenants_bytes(tmp_path):
    store = SessionStore(tmp_path / "s.db")
    _put(store, "t1", "c", time.time(), size=5000)
    check_quota(store, "t2", 100)
    with pytest.raises(Exception, match="quota"):
        check_quota(store, "t1", 5000)


V1_SCHEMA = """
CREATE TABLE responses (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT NOT NULL,
    previous_id TEXT, created_at REAL NOT NULL, body TEXT NOT NULL, state TEXT NOT NULL,
    token_ids BLOB NOT NULL, prompt_len INTEGER NOT NULL);
CREATE TABLE chunks (id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT NULL,
    session_id TEXT NOT NULL, kind TEXT NOT NULL, source TEXT NOT NULL, text TEXT NOT NULL);
INSERT INTO responses VALUES ('r1', 't', 'r1', NULL, 1.0, '{}', '{}', x'01000000', 1);
INSERT INTO chunks (tenant, session_id, kind, source, text) VALUES ('t', 'r1', 'document',
    'kept.txt', 'kept'), ('t', 'lost', 'document', 'orphan.txt', 'orphan');
PRAGMA user_version = 1;
"""


def test_a_schema_1_file_is_migrated_with_auto_vacuum(tmp_path):
    path = tmp_path / "v1.db"
    db = sqlite3.connect(path)
    db.executescript(V1_SCHEMA)
    db.close()
    store = SessionStore(path)
    assert [c.text for c in store.chunks("t", "r1")] == ["kept"]
    assert store.chunks("t", "lost") == []
    with store._serving():
        assert store._db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
        assert store._db.execute("PRAGMA user_version").fetchone()[0] == 2


def test_migration_is_safe_on_a_file_set_back_to_schema_1(tmp_path):
    path = tmp_path / "v1.db"
    SessionStore(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 1")  # as after a downgrade by hand
    db.close()
    SessionStore(path).close()  # before: "duplicate column name: response_id"
