"""Incremental Server-Sent Events parser for OpenAI-style streams.

The bytes of an SSE stream arrive in arbitrary pieces: one TCP read may hold half a JSON event,
three events, or a bare keep-alive comment. :class:`SSEParser` is fed those pieces in order and
returns every event completed so far. It follows the WHATWG "event stream" rules that matter
here:

- bytes are decoded as UTF-8 incrementally (a character split across pieces stays whole);
- lines end in ``\\n``, ``\\r\\n`` or ``\\r`` (a ``\\r`` at the end of a piece waits for the next
  piece, which may start with its ``\\n``);
- a line starting with ``:`` is a comment (``: keep-alive``, ``: ping``) and is ignored;
- ``data:`` lines (one optional space after the colon) accumulate; several in one event are
  joined with ``\\n``;
- a blank line dispatches the event; an event without ``data`` lines is dropped;
- other fields (``event:``, ``id:``, ``retry:``) are ignored, as OpenAI servers never need them.

Invariant: the concatenation of the pieces fed decides the events returned, not how it was cut.
"""

from __future__ import annotations

import codecs


class SSEParser:
    """Turns stream pieces (bytes) into the ``data`` payloads (str) of complete events."""

    def __init__(self) -> None:
        self._buffer = ""
        self._data: list[str] = []
        self._pending_cr = False
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes | str) -> list[str]:
        """Add one piece of the stream; return the data of each event it completed, in order."""
        text = self._decoder.decode(piece) if isinstance(piece, bytes) else piece
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]
        self._pending_cr = text.endswith("\r")
        self._buffer += text
        events: list[str] = []
        lines = self._buffer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._buffer = lines.pop()  # the unterminated tail waits for more bytes
        for line in lines:
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[str]:
        """End of stream: dispatch a last event that lacked its closing blank line."""
        events = self.feed("\n\n") if (self._buffer or self._data) else []
        return events

    def _line(self, line: str) -> str | None:
        if line == "":
            if not self._data:
                return None
            event, self._data = "\n".join(self._data), []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None
