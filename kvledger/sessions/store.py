"""The session state store: one SQLite file (stdlib ``sqlite3``, WAL journal).

Tables:

- ``responses``: one row per stored response: its tenant (a hash of the API key), its
  conversation (``session_id``, the id of the conversation's first response), the OpenAI
  response object (JSON), the conversation state the memory policy needs (JSON) and the exact
  token ids of the whole conversation up to and including this reply (``uint32`` little-endian
  blob), with ``prompt_len`` of them being this turn's prompt.
- ``chunks``: retrievable text of a conversation: document chunks and segment notes, each
  owned by the response whose turn attached or wrote it (``response_id``).

Deleting is real deletion: a response is removed with the chunks it owns, in one transaction,
``secure_delete`` overwrites the freed content, ``auto_vacuum = INCREMENTAL`` gives the freed
pages back to the file system and a WAL checkpoint (``TRUNCATE``) empties the write-ahead log
that still held them. Schema 1 files (chunks without an owner, no auto-vacuum) are migrated
once, with a ``VACUUM``.

Opening never rewrites an existing file before checking it: ``PRAGMA quick_check`` runs first,
so a corrupt or foreign file, or one another process holds locked, is refused with
:class:`StateStoreError` and left byte-for-byte as it was. One connection serves all threads,
guarded by a lock (the HTTP thread and the test client's portal thread both use it).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvledger.sessions.errors import StateStoreError, StateStoreUnavailableError

SCHEMA_VERSION = 2
OPEN_TIMEOUT_S = 2.0  # how long opening waits for another process's lock before refusing
BUSY_TIMEOUT_MS = 10_000  # afterwards, how long a write waits for a concurrent writer

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    previous_id TEXT,
    created_at REAL NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL,
    token_ids BLOB NOT NULL,
    prompt_len INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_session ON responses (tenant, session_id, created_at);
CREATE TABLE IF NOT EXISTS chunks (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    tenant TEXT NOT NULL,
    session_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    source TEXT NOT NULL,
    text TEXT NOT NULL,
    response_id TEXT
);
CREATE INDEX IF NOT EXISTS chunks_by_session ON chunks (tenant, session_id);
CREATE INDEX IF NOT EXISTS chunks_by_response ON chunks (response_id);
"""


@dataclass
class StoredResponse:
    """One stored turn. ``token_ids[:prompt_len]`` was its prompt, the rest its reply."""

    id: str
    tenant: str
    session_id: str
    previous_id: str | None
    body: dict
    state: dict
    token_ids: list[int]
    prompt_len: int
    created_at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Chunk:
    """A retrievable passage: ``kind`` is ``"document"`` or ``"note"``."""

    id: int
    kind: str
    source: str
    text: str


@dataclass(frozen=True)
class SessionSummary:
    """One conversation of a tenant: its first and latest response ids and its turn count."""

    session_id: str
    last_response_id: str
    turns: int
    updated_at: float


def _pack(ids: list[int]) -> bytes:
    arr = array("I", ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def _unpack(blob: bytes) -> list[int]:
    arr = array("I")
    arr.frombytes(blob)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tolist()


def _hint(exc: sqlite3.DatabaseError) -> str:
    """What to do about a state DB that cannot be opened; only a damaged or foreign file is
    called unhealthy (never a good file that is locked or on a read-only file system)."""
    text = str(exc)
    if "locked" in text:
        return "another process holds it locked; stop it or use another --state-db"
    if "readonly" in text or "read-only" in text or "unable to open" in text:
        return ("the file or its folder is read-only, and the server writes to it; make them "
                "writable or use another --state-db")
    if "newer than" in text:
        return "a newer kvledger wrote it; use that version or another --state-db"
    return "it is not a healthy SQLite database; move it away or use another --state-db"


class SessionStore:
    """Stored responses and chunks of every tenant.

    Args:
        path: the SQLite file (created with its folder if absent) or ``":memory:"``.

    Raises:
        StateStoreError: the file is not a healthy SQLite database, is locked by another
            process, or has a newer schema; the file is not modified.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        if self.path != ":memory:":
            try:
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StateStoreError(f"cannot create the folder of the state DB {self.path}: "
                                      f"{exc.strerror}; use another --state-db") from None
        try:
            self._db = sqlite3.connect(self.path, timeout=OPEN_TIMEOUT_S,
                                       check_same_thread=False, isolation_level=None)
            self._check_and_migrate()
        except sqlite3.DatabaseError as exc:
            raise StateStoreError(f"cannot use the state DB {self.path}: {exc} "
                                  f"({_hint(exc)}; the file was left untouched)") from None
        self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")

    def _check_and_migrate(self) -> None:
        rows = self._db.execute("PRAGMA quick_check").fetchall()
        if rows != [("ok",)]:
            raise sqlite3.DatabaseError("integrity check failed: " + "; ".join(
                str(r[0]) for r in rows[:3]))
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise sqlite3.DatabaseError(f"schema version {version} is newer than this "
                                        f"kvledger's {SCHEMA_VERSION}")
        self._db.execute("PRAGMA secure_delete = ON")
        if version == 0:  # a new file: auto-vacuum must be chosen before the first table
            self._db.execute("PRAGMA auto_vacuum = INCREMENTAL")
        if self.path != ":memory:":
            self._db.execute("PRAGMA journal_mode = WAL")
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if version == 1:  # chunks gain an owner; those of turns never stored go
                columns = {row[1] for row in self._db.execute("PRAGMA table_info(chunks)")}
                if "response_id" not in columns:  # (a file an older kvledger set back to 1)
                    self._db.execute("ALTER TABLE chunks ADD COLUMN response_id TEXT")
                self._db.execute("DELETE FROM chunks WHERE NOT EXISTS (SELECT 1 FROM responses r"
                                 " WHERE r.tenant = chunks.tenant"
                                 " AND r.session_id = chunks.session_id)")
            for statement in filter(str.strip, SCHEMA.split(";")):
                self._db.execute(statement)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.DatabaseError:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        if version == 1:  # turn auto-vacuum on for an existing file (rewrites it once)
            self._db.execute("PRAGMA auto_vacuum = INCREMENTAL")
            self._db.execute("VACUUM")

    @property
    def journal_mode(self) -> str:
        """The journal mode SQLite reports (``wal`` for a file)."""
        with self._lock:
            return self._db.execute("PRAGMA journal_mode").fetchone()[0]

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        """Hold the connection's lock; an SQLite failure becomes StateStoreUnavailableError."""
        with self._lock:
            try:
                yield
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                what = ("locked by another process" if "locked" in str(exc) or "busy" in str(exc)
                        else "failing")
                raise StateStoreUnavailableError(
                    f"the state DB {self.path} is {what} ({exc}; waited "
                    f"{BUSY_TIMEOUT_MS / 1000:g} s); the turn was not stored, retry later"
                ) from None

    def close(self) -> None:
        """Close the connection (the WAL is checkpointed into the file)."""
        with self._lock:
            self._db.close()

    def put_response(self, rec: StoredResponse) -> None:
        """Insert or replace one response row."""
        with self._serving():
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (rec.id, rec.tenant, rec.session_id, rec.previous_id, rec.created_at,
                 json.dumps(rec.body), json.dumps(rec.state), _pack(rec.token_ids),
                 rec.prompt_len))

    def get_response(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response with this id, or None (also for another tenant's)."""
        with self._serving():
            row = self._db.execute(
                "SELECT id, tenant, session_id, previous_id, body, state, token_ids, prompt_len,"
                " created_at FROM responses WHERE id = ? AND tenant = ?",
                (response_id, tenant)).fetchone()
        if row is None:
            return None
        return StoredResponse(row[0], row[1], row[2], row[3], json.loads(row[4]),
                              json.loads(row[5]), _unpack(row[6]), row[7], row[8])

    def delete_response(self, tenant: str, response_id: str) -> bool:
        """Delete one response and the chunks it owns, and reclaim their pages; False when
        the tenant has none with this id."""
        with self._serving():
            self._db.execute("BEGIN IMMEDIATE")
            cur = self._db.execute("DELETE FROM responses WHERE id = ? AND tenant = ?",
                                   (response_id, tenant))
            if cur.rowcount:
                self._db.execute("DELETE FROM chunks WHERE response_id = ? AND tenant = ?",
                                 (response_id, tenant))
            self._db.execute("COMMIT")
            if cur.rowcount:
                self._reclaim()
        return cur.rowcount > 0

    def delete_conversation(self, tenant: str, session_id: str) -> None:
        """Delete every response and chunk of a conversation, and reclaim their pages."""
        with self._serving():
            self._db.execute("BEGIN IMMEDIATE")
            for table in ("responses", "chunks"):
                self._db.execute(f"DELETE FROM {table} WHERE tenant = ? AND session_id = ?",
                                 (tenant, session_id))
            self._db.execute("COMMIT")
            self._reclaim()

    def _reclaim(self) -> None:
        """Give freed pages back to the file system and empty the WAL (caller holds the lock)."""
        self._db.executescript("PRAGMA incremental_vacuum;")  # runs to completion; execute()
        # would free one page per call
        if self.path != ":memory:":
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def add_chunks(self, tenant: str, session_id: str, kind: str, source: str,
                   texts: list[str], owner: str | None = None) -> None:
        """Append retrievable passages to a conversation, owned by response ``owner``."""
        with self._serving():
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany(
                "INSERT INTO chunks (tenant, session_id, kind, source, text, response_id)"
                " VALUES (?,?,?,?,?,?)", [(tenant, session_id, kind, source, t, owner)
                                          for t in texts])
            self._db.execute("COMMIT")

    def delete_chunks_of(self, tenant: str, owner: str) -> None:
        """Delete the chunks a response owns (its turn was not stored) and reclaim them."""
        with self._serving():
            self._db.execute("DELETE FROM chunks WHERE tenant = ? AND response_id = ?",
                             (tenant, owner))
            self._reclaim()

    def delete_orphans(self) -> int:
        """Delete chunks whose owner was never stored (a turn cut by a crash); call when no
        turn runs. Returns how many."""
        with self._serving():
            n = self._db.execute("DELETE FROM chunks WHERE response_id IS NOT NULL AND"
                                 " response_id NOT IN (SELECT id FROM responses)").rowcount
            if n:
                self._reclaim()
        return n

    def used_bytes(self) -> int:
        """Bytes of the file's pages in use (its size less the free pages)."""
        with self._serving():
            pages, free, size = (self._db.execute(f"PRAGMA {p}").fetchone()[0]
                                 for p in ("page_count", "freelist_count", "page_size"))
        return (pages - free) * size

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes of a tenant's stored data (responses' JSON and token ids, chunks' text)."""
        queries = (("SELECT SUM(length(CAST(body AS BLOB)) + length(CAST(state AS BLOB)) + "
                   "length(token_ids)) FROM responses WHERE tenant = ?"),
                   "SELECT SUM(length(CAST(text AS BLOB))) FROM chunks WHERE tenant = ?")
        with self._serving():
            responses, chunks = (self._db.execute(q, (tenant,)).fetchone()[0] or 0
                                 for q in queries)
        return responses + chunks

    def conversations_oldest_first(self) -> list[tuple[str, str, float]]:
        """Every conversation as ``(tenant, session_id, last activity)``, least recent first."""
        with self._serving():
            return self._db.execute(
                "SELECT tenant, session_id, MAX(created_at) AS t FROM responses"
                " GROUP BY tenant, session_id ORDER BY t").fetchall()

    def chunks(self, tenant: str, session_id: str) -> list[Chunk]:
        """Every passage of a conversation, in insertion order."""
        with self._serving():
            rows = self._db.execute(
                "SELECT id, kind, source, text FROM chunks WHERE tenant = ? AND session_id = ?"
                " ORDER BY id", (tenant, session_id)).fetchall()
        return [Chunk(*row) for row in rows]

    def sessions(self, tenant: str, limit: int = 50) -> list[SessionSummary]:
        """The tenant's conversations, most recently continued first."""
        with self._serving():
            rows = self._db.execute(
                "SELECT session_id, COUNT(*), MAX(created_at) FROM responses WHERE tenant = ?"
                " GROUP BY session_id ORDER BY MAX(created_at) DESC LIMIT ?",
                (tenant, limit)).fetchall()
            out = []
            for session_id, turns, updated in rows:
                last = self._db.execute(
                    "SELECT id FROM responses WHERE tenant = ? AND session_id = ?"
                    " ORDER BY created_at DESC LIMIT 1", (tenant, session_id)).fetchone()[0]
                out.append(SessionSummary(session_id, last, turns, updated))
        return out
