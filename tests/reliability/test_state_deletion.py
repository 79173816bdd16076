"""Deleting a response over HTTP removes its document from the state DB on disk (live server,
fake engine, a file state DB), with the server still running."""

from __future__ import annotations

import base64

import httpx
import pytest
from rel_servers import FakeServerProcess

pytestmark = pytest.mark.reliability

MARKER = b"OKAPI-5521-GARNET"
DOCUMENT = b" ".join(MARKER + b" paragraph %d of the board minutes." % i for i in range(12_000))


def _on_disk(path) -> bytes:
    return b"".join(p.read_bytes() for p in (path, path.with_name(path.name + "-wal"))
                    if p.exists())


def test_deleted_documents_leave_the_file_and_the_file_shrinks(tmp_path):
    path = tmp_path / "state.db"
    server = FakeServerProcess(tmp_path / "server.log", "--state-db", str(path))
    try:
        part = {"type": "input_file", "filename": "minutes.txt",
                "file_data": base64.b64encode(DOCUMENT).decode()}
        ids = []
        for _ in range(3):
            r = httpx.post(server.url + "/v1/responses", timeout=60, json={
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi."},
                                                       part]}], "max_output_tokens": 2})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        full = len(_on_disk(path))
        assert MARKER in _on_disk(path) and full > 3 * len(DOCUMENT)
        for response_id in ids:
            assert httpx.delete(f"{server.url}/v1/responses/{response_id}").status_code == 200
        assert MARKER not in _on_disk(path)
        assert len(_on_disk(path)) < full // 10
        assert "Traceback" not in server.log_text()
    finally:
        server.close()
