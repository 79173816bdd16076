"""Tenants cannot read each other's prompts through the prefix cache, on every route.

The attack (CVE-2025-46570): tenant B sends a guess of tenant A's prompt and reads
``cached_tokens``; a right guess must get no more cached tokens than a wrong one. The fake
engine's prefix cache hits whole blocks of a prompt seen before under the same salt, as the
engine's does (the engine's salt isolation is tested in tests/engine/kv/test_prefix.py); the
bundled model repeats the check on the real engine (slow).
"""

from __future__ import annotations

import pytest

KEYS = ["key-a", "key-b"]
SECRET = "The launch code of project Falcon is 4417-alpha; keep it between us, please. " * 2
WRONG = "Xhe" + SECRET[3:]  # same length, wrong from the first block on
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def _body(route: str, text: str, **extra) -> dict:
    if route == "/v1/completions":
        return {"prompt": text, "max_tokens": 2, **extra}
    if route == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}
    return {"input": text, "max_output_tokens": 2, "store": False, **extra}


def _cached(client, route: str, key: str, text: str, **extra) -> int:
    r = client.post(route, json=_body(route, text, **extra),
                    headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    details = usage.get("prompt_tokens_details") or usage["input_tokens_details"]
    return details["cached_tokens"]


@pytest.mark.parametrize("route", ROUTES)
def test_a_right_guess_from_another_key_hits_no_more_than_a_wrong_one(make_app, route):
    client = make_app(api_key=KEYS)
    _cached(client, route, "key-a", SECRET)
    right = _cached(client, route, "key-b", SECRET)
    wrong = _cached(client, route, "key-b", WRONG)
    assert right <= wrong
    assert _cached(client, route, "key-a", SECRET) >= 32  # the owner's own repeat does hit


@pytest.mark.parametrize("route", ROUTES)
def test_a_request_cache_salt_adds_to_the_tenants(make_app, route):
    client = make_app(api_key=KEYS)
    _cached(client, route, "key-a", SECRET, cache_salt="s1")
    assert _cached(client, route, "key-a", SECRET, cache_salt="s2") == 0
    assert _cached(client, route, "key-a", SECRET) == 0
    assert _cached(client, route, "key-b", SECRET, cache_salt="s1") == 0
    assert _cached(client, route, "key-a", SECRET, cache_salt="s1") >= 32


@pytest.mark.parametrize("route", ROUTES)
def test_sharing_across_keys_is_opt_in(make_app, route):
    client = make_app(api_key=KEYS, share_prefix_cache_across_keys=True)
    _cached(client, route, "key-a", SECRET)
    assert _cached(client, route, "key-b", SECRET) >= 32
    assert _cached(client, route, "key-b", SECRET, cache_salt="own") == 0


def test_without_keys_cache_salt_still_separates(make_app):
    client = make_app()
    _cached(client, "/v1/completions", "none", SECRET, cache_salt="alice")
    assert _cached(client, "/v1/completions", "none", SECRET, cache_salt="bob") == 0
    assert _cached(client, "/v1/completions", "none", SECRET, cache_salt="alice") >= 32


def test_an_empty_cache_salt_is_400(make_app):
    r = make_app().post("/v1/completions", json=_body("/v1/completions", "x", cache_salt=""))
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


@pytest.fixture(scope="module")
def bundled():
    import torch

    from kvledger.model.weights.loader import load_tokenizer, load_weights

    spec, weights = load_weights("default", torch.float32)
    return spec, weights, load_tokenizer("default")


@pytest.mark.slow
@pytest.mark.parametrize("route", ROUTES)
def test_real_engine_gives_another_key_no_hit_on_a_right_guess(app_client, bundled, route):
    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="default", dtype="fp32", num_blocks=256), *bundled)
    client = app_client(engine, api_key=KEYS)
    _cached(client, route, "key-a", SECRET)
    right = _cached(client, route, "key-b", SECRET)
    wrong = _cached(client, route, "key-b", WRONG)
    assert right <= wrong
    assert _cached(client, route, "key-a", SECRET) >= 32
