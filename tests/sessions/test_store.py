"""The SQLite state store: round trips, WAL, and refusing bad files without touching them."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

from kvledger.sessions.errors import StateStoreError
from kvledger.sessions.store import SessionStore, StoredResponse


def test_round_trip_and_tenants(tmp_path):
    store = SessionStore(tmp_path / "s.db")
    ids = [0, 1, 49151, 2**32 - 1]
    store.put_response(StoredResponse("r1", "t1", "r1", None, {"a": 1}, {"b": [2]}, ids, 2))
    rec = store.get_response("t1", "r1")
    assert (rec.token_ids, rec.prompt_len, rec.body, rec.state) == (ids, 2, {"a": 1},
                                                                    {"b": [2]})
    assert store.get_response("t2", "r1") is None
    assert not store.delete_response("t2", "r1")
    assert store.delete_response("t1", "r1") and store.get_response("t1", "r1") is None
    assert store.journal_mode == "wal"


def test_a_file_that_is_not_sqlite_is_refused_untouched(tmp_path):
    path = tmp_path / "notes.db"
    content = b"my precious notes\n" * 500
    path.write_bytes(content)
    with pytest.raises(StateStoreError, match="not a database.*left untouched"):
        SessionStore(path)
    assert path.read_bytes() == content


def test_a_corrupt_database_is_refused_untouched(tmp_path):
    path = tmp_path / "s.db"
    store = SessionStore(path)
    for i in range(200):
        store.put_response(StoredResponse(f"r{i}", "t", "r", None, {"x": "y" * 200}, {},
                                          list(range(100)), 50))
    store.close()
    data = bytearray(path.read_bytes())
    data[4096 * 2: 4096 * 2 + 512] = b"\xff" * 512  # smash a page inside the table
    path.write_bytes(bytes(data))
    with pytest.raises(StateStoreError, match="cannot use the state DB"):
        SessionStore(path)
    assert path.read_bytes() == bytes(data)


def test_a_locked_database_is_refused(tmp_path):
    path = tmp_path / "s.db"
    SessionStore(path).close()
    script = ("import sqlite3,sys,time; c=sqlite3.connect(sys.argv[1], isolation_level=None);"
              " c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(30)")
    holder = subprocess.Popen(  # another process holds the write lock
        [sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StateStoreError, match="locked"):
            SessionStore(path)
    finally:
        holder.kill()
        holder.wait()
    assert sqlite3.connect(path).execute("PRAGMA quick_check").fetchone() == ("ok",)


def _read_only(folder):
    """Make ``folder`` and its files read-only even for root (chattr +i); undo callable."""
    import os
    import shutil
    import subprocess

    paths = [str(p) for p in folder.iterdir()] + [str(folder)]
    if os.geteuid() != 0:
        for p in paths:
            os.chmod(p, 0o555 if p == str(folder) else 0o444)
        return lambda: [os.chmod(p, 0o755) for p in paths]
    if shutil.which("chattr") is None or subprocess.run(
            ["chattr", "+i", *paths], check=False, capture_output=True).returncode:
        pytest.skip("cannot make a folder read-only here")
    return lambda: subprocess.run(["chattr", "-i", *paths], check=True)


def test_a_healthy_database_on_a_read_only_folder_is_called_read_only(tmp_path):
    folder = tmp_path / "ro"
    SessionStore(folder / "s.db").close()
    undo = _read_only(folder)
    try:
        with pytest.raises(StateStoreError) as err:
            SessionStore(folder / "s.db")
    finally:
        undo()
    assert "read-only" in str(err.value) and "move it away" not in str(err.value)
