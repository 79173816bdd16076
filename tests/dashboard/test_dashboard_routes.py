"""Dashboard routes through the app (TestClient): pages, assets, the key, CSP, the planner."""

from __future__ import annotations

import re
from typing import ClassVar

import pytest

from kvledger.device import resolve

KEY = "s3cret"


class IdleEngine:
    """The engine API the app needs, with nothing to run (no scheduler: stats only)."""

    model_name = "idle-model"
    device = resolve("cpu")
    max_model_len = 128
    tokenizer = None
    cache_config: ClassVar[dict] = {"block_size": "16", "cache_dtype": "fp32"}

    def stats(self) -> dict:
        return {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0}

    def has_unfinished_requests(self) -> bool:
        return False


@pytest.fixture
def client_for(app_client):
    return lambda **kwargs: app_client(IdleEngine(), **kwargs)


def test_pages_are_static_and_say_whether_a_key_is_needed(client_for):
    open_page = client_for().get("/dashboard")
    assert open_page.status_code == 200
    assert 'data-auth="none"' in open_page.text
    keyed = client_for(api_key=KEY)
    for path in ("/dashboard", "/dashboard/plan"):
        r = keyed.get(path)  # the page holds no data, so it needs no key
        assert r.status_code == 200 and 'data-auth="required"' in r.text
        assert "idle-model" not in r.text


def test_pages_reference_no_other_host(client_for):
    client = client_for()
    for path in ("/dashboard", "/dashboard/plan", "/dashboard/assets/common.js",
                 "/dashboard/assets/dashboard.js", "/dashboard/assets/plan.js",
                 "/dashboard/assets/dashboard.css"):
        r = client.get(path)
        assert r.status_code == 200, path
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", r.text), path
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    page = client.get("/dashboard").text
    for src in re.findall(r'(?:src|href)="([^"]+)"', page):
        assert src.startswith("/dashboard") or src == "data:,", src


def test_assets(client_for):
    client = client_for()
    r = client.get("/dashboard/assets/uPlot.iife.min.js")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
    assert "uPlot" in r.text
    assert "MIT" in client.get("/dashboard/assets/uPlot.LICENSE.txt").text
    for bad in ("nope.js", "..%2Fdashboard.py", ".hidden"):
        assert client.get(f"/dashboard/assets/{bad}").status_code == 404


def test_data_routes_need_the_key(client_for):
    client = client_for(api_key=KEY)
    for method, path in (("get", "/dashboard/api/stats"), ("get", "/dashboard/api/catalogue"),
                         ("post", "/dashboard/api/plan")):
        r = getattr(client, method)(path)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = client.get("/dashboard/api/stats", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert r.json()["model"] == "idle-model"


def test_stats_without_a_paged_engine(client_for):
    snap = client_for().get("/dashboard/api/stats").json()
    assert snap["engine_alive"] is True and snap["blocks"] == [] and snap["requests"] == []
    assert set(snap["histograms"]) == {"ttft", "tpot", "itl"}
    assert snap["alerts"] == []


def test_catalogue_route(client_for):
    body = client_for().get("/dashboard/api/catalogue").json()
    ids = [m["model_id"] for m in body["models"]]
    assert "meta-llama/Llama-3.1-8B" in ids
    assert "H100-SXM" in body["devices"] and "int4" in body["kv_formats"]


def test_plan_route_matches_the_cli_json(client_for):
    r = client_for().post("/dashboard/api/plan", json={
        "model": "meta-llama/llama-3.1-8b", "context": "8k", "kv_dtype": "fp8", "plot": True})
    assert r.status_code == 200, r.text
    body = r.json()
    # fp8: 1 byte per element + an fp32 scale per 16-token block, KV head and K/V
    assert body["plan"]["kv_bytes_per_token"] == 32 * 8 * (2 * 16 * 128 + 2 * 4) // 16
    assert body["plan"]["contexts"][0]["context"] == 8192
    assert body["plot_png"].startswith("iVBORw0KGgo")  # base64 of the PNG signature


@pytest.mark.parametrize("body, status, needle", [
    ({"model": "meta-llama/Llama-3-8B"}, 404, "closest: meta-llama/Llama-3.1-8B"),
    ({"model": "/etc/passwd"}, 404, "catalogue"),  # the form never reads server paths
    ({"model": "openai/gpt-oss-20b", "device": "TPU9"}, 400, "unknown device"),
    ({"model": "openai/gpt-oss-20b", "context": "lots"}, 400, "--context"),
    ({"model": "openai/gpt-oss-20b", "tp": 0}, 400, "tp"),
    ({"model": "openai/gpt-oss-20b", "kv_dtype": "fp7"}, 400, "fp7"),
])
def test_plan_route_errors(client_for, body, status, needle):
    r = client_for().post("/dashboard/api/plan", json={"plot": False, **body})
    assert r.status_code == status, r.text
    assert needle.lower() in r.json()["error"]["message"].lower()
