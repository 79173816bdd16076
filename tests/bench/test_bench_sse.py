"""SSE parsing: comments, CRLF, multi-line data, and any cut of the byte stream."""

from __future__ import annotations

from kvledger.bench.sse import SSEParser

STREAM = (
    b": keep-alive\r\n\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b"event: message\nid: 7\ndata: line one\ndata: line two\n\n"
    b":\n\n"
    b'data:{"b": "\xc3\xa9"}\r\r'
    b"data: [DONE]\n\n"
)
EXPECTED = ['{"a": 1}', "line one\nline two", '{"b": "\u00e9"}', "[DONE]"]


def parse(pieces: list[bytes]) -> list[str]:
    parser = SSEParser()
    events = [e for piece in pieces for e in parser.feed(piece)]
    return events + parser.close()


def test_whole_stream():
    assert parse([STREAM]) == EXPECTED


def test_every_two_way_cut_gives_the_same_events():
    # including cuts inside "\r\n", inside the JSON and inside the 2-byte UTF-8 character
    for k in range(len(STREAM) + 1):
        assert parse([STREAM[:k], STREAM[k:]]) == EXPECTED, k


def test_byte_by_byte():
    assert parse([STREAM[i : i + 1] for i in range(len(STREAM))]) == EXPECTED


def test_last_event_without_blank_line_is_flushed_on_close():
    assert parse([b'data: {"x": 2}']) == ['{"x": 2}']


def test_comment_only_stream_has_no_events():
    assert parse([b": ping\n\n: ping\n\n"]) == []
