"""Input size limits (``max_input_chars``, ``max_input_items``) on every route, before
validation or tokenizing; the app's own limits apply (not the defaults)."""

from __future__ import annotations

import pytest

from kvledger.server.limits.input_size import check_input_size
from kvledger.server.limits.server_limits import ServerLimits

MESSAGES = [{"role": "user", "content": "hi"}] * 4
BODIES = {
    "/v1/completions": {"prompt": ["a", "b", "c", "d"]},
    "/v1/chat/completions": {"messages": MESSAGES},
    "/tokenize": {"messages": MESSAGES},
}


@pytest.mark.parametrize("route", list(BODIES))
def test_items_over_the_apps_limit_are_400_naming_the_field(make_client, route):
    client = make_client(limits=ServerLimits(max_input_items=3))
    r = client.post(route, json=BODIES[route])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "input_too_large" and "--max-input-items" in err["message"]
    assert err["param"] in ("prompt", "messages")
    ok = make_client(limits=ServerLimits(max_input_items=4)).post(route, json=BODIES[route])
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("route", list(BODIES))
def test_characters_over_the_limit_are_400(make_client, route):
    client = make_client(limits=ServerLimits(max_input_chars=3))
    r = client.post(route, json=BODIES[route])
    assert r.status_code == 400 and r.json()["error"]["code"] == "input_too_large"
    assert "--max-input-chars" in r.json()["error"]["message"]


def test_token_ids_are_not_items_and_file_data_not_characters():
    check_input_size({"prompt": list(range(10_000))})  # within 4,096 items by default
    check_input_size({"input": [{"role": "user", "content": [
        {"type": "input_file", "file_data": "QQ==" * 400_000}]}]})


def test_a_deep_or_wide_body_is_stopped_at_the_first_excess():
    with pytest.raises(Exception, match="over 4096 items"):
        check_input_size({"messages": [{"role": "user", "content": "a"}] * 1_000_000})
