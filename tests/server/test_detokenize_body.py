"""A ``/detokenize`` body validated a slice of ids at a time gives exactly what one whole-body
validation gives: the same ids, or the same errors at the same places (the oracle: pydantic's
own validation of the whole body). Old code (485cae7): one pydantic call over 1.5 M ids held
the GIL, and with it the event loop, for its whole run."""

from __future__ import annotations

import json

import pytest
from fastapi.exceptions import RequestValidationError
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.server import detokenize_body
from kvledger.server.detokenize_body import _validated, parse_detokenize_body


def outcome(parse, raw: bytes):
    try:
        return ("ok", parse(raw).model_dump())
    except RequestValidationError as exc:
        return ("error", [(e["type"], tuple(e["loc"])) for e in exc.errors()])


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(detokenize_body, "SLICE_BYTES", 8)  # a slice every few ids


IDS = st.lists(st.one_of(st.integers(min_value=0, max_value=1 << 40),
                         st.integers(max_value=-1), st.floats(allow_nan=False,
                                                              allow_infinity=False),
                         st.booleans()), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ids=IDS, model=st.sampled_from([None, "first", "last"]), spaces=st.booleans())
def test_sliced_validation_equals_whole_body_validation(ids, model, spaces):
    detokenize_body.SLICE_BYTES = 8
    try:
        body = {"tokens": ids}
        if model == "first":
            body = {"model": "m", "tokens": ids}
        elif model == "last":
            body = {"tokens": ids, "model": "m"}
        raw = json.dumps(body, indent=1 if spaces else None).encode()
        assert outcome(parse_detokenize_body, raw) == outcome(_validated, raw)
    finally:
        detokenize_body.SLICE_BYTES = 1 << 18


@pytest.mark.parametrize("raw", [
    b"", b"{}", b"[]", b'{"tokens": []}', b'{"tokens": [1, 2,]}', b'{"tokens": [NaN]}',
    b'{"tokens": [1, -2, 3]}', b'{"tokens": [1, 2.5]}', b'{"x": {"tokens": [1]}}',
    b'{"model": "a\\"tokens\\": [1]", "tokens": [7, 8]}', b'{"tokens": [1]} trailing',
    b'{"tokens": [1], "tokens": [2]}', b'{"model": 5, "tokens": [1]}', b'{"tokens": [1]]}',
])
def test_edge_bodies_equal_whole_body_validation(small_slices, raw):
    assert outcome(parse_detokenize_body, raw) == outcome(_validated, raw)


def test_a_long_list_is_validated_in_many_calls(small_slices, monkeypatch):
    calls = []
    ids = detokenize_body._IDS
    monkeypatch.setattr(detokenize_body, "_IDS", type("Spy", (), {
        "validate_json": staticmethod(lambda text: calls.append(len(text))
                                      or ids.validate_json(text))}))
    raw = json.dumps({"tokens": list(range(1000))}).encode()
    assert parse_detokenize_body(raw).tokens == list(range(1000))
    assert len(calls) > 100 and max(calls) < 40
