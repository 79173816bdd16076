"""Every numeric field of every request body (``docs/validation.md``'s table, made from the
bodies' models by ``tests/validation_table.py``): values past each bound, the wrong types, NaN,
infinities, ``1e400``, 2^64 and an integer of 5,000 digits are each a 400 naming the field;
the bounds themselves and hypothesis' draws never get a 500. Old code (485cae7): the
5,000-digit integer got "There was an error parsing the body", naming nothing."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from validation_table import ALSO, http_fields

FIELDS = http_fields()
BASE = {
    "/v1/completions": {"prompt": "x", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/detokenize": {"tokens": [104]},
    "/dashboard/api/plan": {"model": "HuggingFaceTB/SmolLM2-135M", "plot": False},
}
KV_POLICY = {"window": {"policy": "window"}, "sinks": {"policy": "sinks", "window": 16},
             "budget": {"policy": "h2o"}}
HUGE = "9" * 5000  # past Python's 4,300-digit conversion limit


def body(route: str, path: str, literal: str) -> bytes:
    """The route's base body with the field at ``path`` set to the JSON text ``literal``."""
    mark = "__VALUE__"
    data = dict(BASE[route])
    top, _, leaf = path.partition(".")
    if top == "kv_policy":
        data[top] = {**KV_POLICY[leaf], leaf: mark}
    elif leaf == "*":
        data[top] = {"5": mark}
    elif top.endswith("[][]"):
        data[top[:-4]] = [[mark]]
    elif top.endswith("[]"):
        data[top[:-2]] = [mark]
    else:
        data[top] = mark
    return json.dumps(data).replace(f'"{mark}"', literal).encode()


def post(client, route: str, content: bytes):
    return client.post(route, content=content, headers={"content-type": "application/json"})


def names_the_field(error: dict, path: str) -> bool:
    top = path.split(".")[0].removesuffix("[]").removesuffix("[]")
    leaf = path.rsplit(".", 1)[-1]
    message = error["message"]
    return (error["param"] == top or f"'{top}" in message or f"kv_{leaf}" in message
            or "token id" in message and path.endswith("[]"))  # ids past the vocabulary


UNIONS = {"prompt[]": ('"1"', "[1]")}  # a list of texts or of id lists: other branches


def bad_literals(path: str, allowed) -> list[str]:
    out = ["NaN", "Infinity", "-Infinity", "1e400", '"1"', "true", "[1]", "{}", HUGE,
           "-" + HUGE]
    out = [text for text in out if text not in UNIONS.get(path, ())]
    if not allowed.optional:
        out.append("null")
    if allowed.integer:
        out.append("1.5")
    if allowed.lo is not None:
        out.append(json.dumps(allowed.lo if allowed.lo_open else allowed.lo - (
            1 if allowed.integer else 1e-6)))
    if allowed.hi is not None:
        out += [json.dumps(allowed.hi if allowed.hi_open else allowed.hi + (
            1 if allowed.integer else 1e-6)), str(1 << 64)]
    return out


@pytest.fixture(scope="module")
def client(request):
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient

    from kvledger.server.app import create_app

    with TestClient(create_app(FakeEngine()), raise_server_exceptions=False) as made:
        yield made


def test_the_table_covers_every_route_and_field_kind():
    routes = {route for route, _ in FIELDS}
    assert routes == set(BASE)
    assert {("/v1/completions", "logit_bias.*"), ("/v1/completions", "prompt[][]"),
            ("/detokenize", "tokens[]"), ("/v1/responses", "kv_policy.sinks")} <= set(FIELDS)


@pytest.mark.parametrize(("route", "path"), sorted(FIELDS), ids=lambda v: str(v))
def test_each_bad_value_is_a_400_naming_the_field(client, route, path):
    for literal in bad_literals(path, FIELDS[route, path]):
        resp = post(client, route, body(route, path, literal))
        assert resp.status_code == 400, (literal[:20], resp.text)
        error = resp.json()["error"]
        assert names_the_field(error, path), (literal[:20], error)
        assert "Traceback" not in error["message"]


@pytest.mark.parametrize(("route", "path"), sorted(FIELDS), ids=lambda v: str(v))
def test_the_bounds_themselves_are_served(client, route, path):
    allowed = FIELDS[route, path]
    for bound, open_ in ((allowed.lo, allowed.lo_open), (allowed.hi, allowed.hi_open)):
        if bound is not None and not open_:
            resp = post(client, route, body(route, path, json.dumps(bound)))
            assert resp.status_code in (200, 400), resp.text  # 400: e.g. no chat template
            if resp.status_code == 400 and path not in ALSO:  # ALSO: rules beside the range
                assert not names_the_field(resp.json()["error"], path), resp.text


NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.integers(min_value=-(1 << 80), max_value=1 << 80),
                    st.sampled_from([0, 1, -1, 20, 21, 100, 101, 1 << 63, -(1 << 63) - 1]))


@settings(max_examples=150, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(FIELDS)), value=st.one_of(NUMBERS, st.booleans(), st.none(),
                                                             st.text(max_size=5)))
def test_hypothesis_values_never_get_a_500(client, key, value):
    route, path = key
    literal = json.dumps(value, allow_nan=True)
    resp = post(client, route, body(route, path, literal))
    assert resp.status_code in (200, 400), (literal, resp.text)
    allowed = FIELDS[key]
    if isinstance(value, str) and path in UNIONS:
        return  # a list of texts is a prompt too: its own rules, tested elsewhere
    if not allowed.contains(value) and not (isinstance(value, float) and math.isfinite(value)
                                            and value == int(value) and allowed.integer):
        assert resp.status_code == 400, (literal, resp.text)
        assert names_the_field(resp.json()["error"], path), (literal, resp.text)
