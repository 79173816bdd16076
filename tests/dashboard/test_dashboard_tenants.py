"""The dashboard shows a key its own requests; an admin key (--admin-api-key) sees all.

The engine's snapshot is replaced by one row per live request of the fake engine (which has no
paged scheduler), so the test sees exactly which rows the server lets through.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from kvledger.server.dashboard import routes as dashboard
from kvledger.server.dashboard.stats import OTHER, visible_to

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))


@pytest.fixture
def make_client(app_client):
    from fake_engine import FakeEngine

    return lambda engine=None, **kwargs: app_client(engine or FakeEngine(), **kwargs)


def _rows(engine) -> dict:
    ids = sorted(engine.requests)
    return {"stats": engine.stats(), "pool": None, "quota_tokens": None,
            "requests": [{"id": rid} for rid in ids], "blocks": list(range(len(ids))) + [-1]}


def test_visible_to_keeps_a_tenants_rows_and_hides_the_others_blocks():
    snap = {"requests": [{"id": "a1"}, {"id": "b1"}, {"id": "a2"}], "blocks": [0, 1, 2, -1, -3]}
    owners = {"a1": "A", "b1": "B", "a2": "A"}
    mine = visible_to(snap, owners, "A")
    assert [r["id"] for r in mine["requests"]] == ["a1", "a2"]
    assert mine["blocks"] == [0, OTHER, 1, -1, -3]
    assert visible_to(snap, owners, None) is snap


def test_each_key_sees_its_own_requests_and_the_admin_all(make_client, monkeypatch):
    from fake_engine import FakeEngine

    monkeypatch.setattr(dashboard, "engine_snapshot", _rows)
    client = make_client(FakeEngine(step_delay_s=0.02), api_key=["key-a", "key-b"],
                         admin_api_key="boss")

    def generate(key):
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 150,
                                             "ignore_eos": True},
                    headers={"Authorization": f"Bearer {key}"})

    threads = [threading.Thread(target=generate, args=(k,)) for k in ("key-a", "key-b")]
    for t in threads:
        t.start()

    def ids(key):
        r = client.get("/dashboard/api/stats", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return [row["id"] for row in r.json()["requests"]]

    deadline = time.monotonic() + 10
    while len(ids("boss")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    every, mine_a, mine_b = ids("boss"), ids("key-a"), ids("key-b")
    for t in threads:
        t.join()
    assert len(every) == 2 and len(mine_a) == 1 and len(mine_b) == 1
    assert set(mine_a) | set(mine_b) == set(every) and mine_a != mine_b


@pytest.mark.parametrize("key", ["key-a", "boss"])
def test_an_admin_key_is_accepted_like_any_key(make_client, key):
    client = make_client(api_key=["key-a"], admin_api_key=["boss"])
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
