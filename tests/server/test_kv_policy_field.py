"""The ``kv_policy`` extra body field: an object turned into the request's RetentionSpec; bad
objects are a 400 naming kv_policy, and the other requests keep being served."""

import pytest
from fake_engine import FakeEngine

from kvledger.ledger.retention import RetentionSpec

BODY = {"prompt": "hi", "max_tokens": 3}


def test_a_policy_object_reaches_the_engine(make_client):
    engine = FakeEngine()
    seen = []
    add = engine.add_request
    engine.add_request = lambda rid, prompt, params, **kw: (seen.append(params.kv_policy),
                                                            add(rid, prompt, params, **kw))[1]
    client = make_client(engine)
    body = {**BODY, "kv_policy": {"policy": "sinks", "window": 64, "sinks": 2}}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert seen == [RetentionSpec("sinks", window=64, sinks=2)]
    body = {**BODY, "kv_policy": {"policy": "h2o", "budget": 64, "scope": "prompt"}}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert seen[-1] == RetentionSpec("h2o", budget=64, scope="prompt")
    assert seen[-1].scope == "prompt" and seen[0].scope == "always"


@pytest.mark.parametrize("kv_policy, words", [
    ({"policy": "sinks", "window": 64, "size": 1}, "unknown key(s) 'size'"),
    ({"policy": "lru"}, "kv_policy must be one of"),
    ({"policy": "window", "window": 0}, "kv_window must be an integer > 0"),
    ({"policy": "sinks", "window": 8, "sinks": -1}, "kv_sinks must be an integer >= 0"),
    ({"policy": "h2o", "budget": 8, "window": 8}, "no room for heavy hitters"),
    ({"policy": "sinks", "window": 8, "positions": "rotated"}, "kv_positions must be one of"),
    ({"policy": "h2o", "budget": 64, "positions": "cache"}, "applies to window and sinks"),
    ({"policy": "sinks", "window": 8, "scope": "decode"}, "kv_scope must be one of"),
    ({"policy": "snapkv", "budget": 64, "scope": "prompt"}, "kv_scope applies to"),
    ({"policy": "full", "scope": "always"}, "kv_scope applies to"),
    ({"policy": "h2o", "budget": 64, "h2o_scores": "max"}, "h2o_scores must be one of"),
    ("sinks", "kv_policy"),
])
def test_bad_policy_objects_are_400_and_others_are_served(make_client, kv_policy, words):
    client = make_client()
    resp = client.post("/v1/completions", json={**BODY, "kv_policy": kv_policy})
    assert resp.status_code == 400, resp.text
    assert words in resp.json()["error"]["message"]
    assert client.post("/v1/completions", json=BODY).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "kv_policy": kv_policy}
    assert client.post("/v1/chat/completions", json=chat).status_code == 400
