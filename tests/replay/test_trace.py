"""The trace format: block hashes, parsing, and one-line errors with line numbers."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvledger.replay.trace import TraceError, TraceWriter, block_hashes, read_trace

HEADER = {"type": "header", "format": "kvledger-trace", "version": 1, "hash_block_size": 4}


def _write(path, *lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_block_hashes_are_the_documented_unsalted_chain():
    """sha256 of repr((parent, tokens, ())), chained: computed here from the formula."""
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    h0 = hashlib.sha256(repr((None, (5, 6, 7, 8), ())).encode()).digest()
    h1 = hashlib.sha256(repr((h0, (9, 10, 11, 12), ())).encode()).digest()
    assert block_hashes(tokens, 4) == [h0.hex(), h1.hex()]  # the partial block is not hashed


def test_writer_and_reader_round_trip(tmp_path):
    w = TraceWriter(tmp_path / "t.jsonl", "test", "m", private=True, hash_block_size=4)
    w.write({"type": "request", "id": "b", "arrival_s": 2.0, **w.prompt_fields([1] * 9),
             "max_tokens": 3})
    w.write({"type": "request", "id": "a", "arrival_s": 1.0, "prompt_token_ids": [1, 2],
             "max_tokens": None})
    w.write({"type": "finish", "id": "b", "output_tokens": 2})
    w.write({"type": "future-kind", "anything": 1})
    w.close()
    trace = read_trace(tmp_path / "t.jsonl")
    assert [r.id for r in trace.requests] == ["a", "b"]  # arrival order
    b = trace.requests[1]
    assert b.prompt_tokens == 9 and len(b.block_hashes) == 2 and b.prompt_token_ids is None
    assert b.target_output_tokens == 2  # the finish line wins over max_tokens
    assert trace.requests[0].target_output_tokens is None


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "t.jsonl:3: not valid JSON"),
    ('[1, 2]', "t.jsonl:3: each line must be a JSON object"),
    ({"type": "request", "id": "x"}, "t.jsonl:3: field 'arrival_s'"),
    ({"type": "request", "id": "x", "arrival_s": 0, "prompt_token_ids": []},
     "t.jsonl:3: prompt_token_ids must be a non-empty list"),
    ({"type": "request", "id": "a", "arrival_s": 0, "prompt_tokens": 3}, "t.jsonl:3: request id"),
    ({"type": "request", "id": "x", "arrival_s": 0, "prompt_tokens": 3,
      "block_hashes": ["00"]}, "t.jsonl:3: 1 block hashes of 4 tokens exceed"),
    ({"type": "finish", "id": "nobody"}, "t.jsonl:3: finish of unknown request"),
    ({"type": "step", "start_s": 0}, "t.jsonl:3: field 'duration_s'"),
])
def test_malformed_line_names_its_number(tmp_path, line, message):
    first = {"type": "request", "id": "a", "arrival_s": 0, "prompt_tokens": 5}
    path = _write(tmp_path / "t.jsonl", HEADER, first, line)
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_trace(path)


def test_header_missing_or_other_version(tmp_path):
    with pytest.raises(TraceError, match="t.jsonl:1: the first line must be the kvledger-trace"):
        read_trace(_write(tmp_path / "t.jsonl", {"type": "request"}))
    with pytest.raises(TraceError, match="version 2"):
        read_trace(_write(tmp_path / "t.jsonl", HEADER | {"version": 2}))
    with pytest.raises(TraceError, match="not found"):
        read_trace(tmp_path / "missing.jsonl")
