"""Incremental detokenization: streamed deltas join to the full decode; stop strings cut text."""

from __future__ import annotations

import pytest

from kvledger.engine.output.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from kvledger.model.weights.loader import load_tokenizer

    return load_tokenizer("default")


TEXT = "Héllo wörld — naïve café 東京 🙂 and the KV cache, again and again."


def _stream(tokenizer, ids, stop):
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces, stopped = [], False
    for i in range(1, len(ids) + 1):
        delta, stopped = detok.update(ids[:i])
        pieces.append(delta)
        if stopped:
            break
    if not stopped:
        pieces.append(detok.flush())
    return "".join(pieces), stopped


def test_deltas_join_to_the_full_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    text, stopped = _stream(tokenizer, ids, [])
    assert not stopped
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_is_cut_and_never_streamed(tokenizer):
    ids = tokenizer.encode(TEXT)
    text, stopped = _stream(tokenizer, ids, ["cache"])
    assert stopped
    assert text == TEXT[: TEXT.index("cache")]


def test_no_tokenizer_gives_empty_text():
    assert IncrementalDetokenizer(None, ["x"]).update([1, 2]) == ("", False)
