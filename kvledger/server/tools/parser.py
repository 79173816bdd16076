"""ToolCallParser: a reply's text -> its content and tool calls, incrementally.

Fed the text deltas of a reply as they are generated, it returns events in order: content text
(never any part of a call's opening, which is held back until it is known not to be one), the
start of a call (its name), and fragments of the call's arguments, exactly as generated, so
the streamed fragments of a call concatenate to the arguments of the whole reply. The end of
the arguments (a JSON object) is found by counting brackets outside strings. A call still
open when the reply ends (cut by ``max_tokens``) is not reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.server.tools.formats import ToolFormat


@dataclass
class ToolCall:
    """One call: the function's name and its arguments (JSON text)."""

    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class _Scan:
    """Bracket depth of a JSON value being read."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def step(self, c: str) -> bool:
        """Read one character; True when it closes the value."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
            return False
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


@dataclass
class ToolCallParser:
    """Splits one reply into content and calls.

    Args:
        fmt: the tool format.
        trigger_visible: False when the trigger is a special token absent from the text.

    Events (from :meth:`feed` and :meth:`finish`): ``("content", text)``, ``("call", index,
    name)``, ``("arguments", index, fragment)``.
    """

    fmt: ToolFormat
    trigger_visible: bool = True
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _state: str = "text"  # text, name, arguments, tail, done
    _scan: _Scan = field(default_factory=_Scan)

    @property
    def opening(self) -> str:
        """The visible text that starts the first call."""
        return (self.fmt.trigger if self.trigger_visible else "") + self.fmt.after_trigger

    def feed(self, delta: str) -> list[tuple]:
        """Events of the next piece of the reply's text."""
        self._buffer += delta
        events: list[tuple] = []
        while self._buffer and self._step(events):
            pass
        return events

    def finish(self) -> list[tuple]:
        """Events at the end of the reply: held-back text that never became a call."""
        if self._state == "text" and self._buffer:
            text, self._buffer = self._buffer, ""
            self.content += text
            return [("content", text)]
        return []

    def _step(self, events: list[tuple]) -> bool:
        """Consume what the buffer allows in the current state; False to wait for more."""
        if self._state == "text":
            return self._text(events)
        if self._state == "name":
            end = self._buffer.find(self.fmt.args_key)
            if end < 0:
                return False
            self.calls.append(ToolCall(self._buffer[:end]))
            events.append(("call", len(self.calls) - 1, self.calls[-1].name))
            self._buffer = self._buffer[end + len(self.fmt.args_key):]
            self._state, self._scan = "arguments", _Scan()
            return True
        if self._state == "arguments":
            return self._arguments(events)
        if self._state == "tail":
            return self._tail()
        self._buffer = ""  # done: what follows the calls is not part of the reply
        return False

    def _text(self, events: list[tuple]) -> bool:
        opening, buf = self.opening, self._buffer
        at = buf.find(opening)
        if at < 0:  # hold back a suffix that may begin the opening
            keep = next((k for k in range(min(len(opening) - 1, len(buf)), 0, -1)
                         if opening.startswith(buf[-k:])), 0)
            text, self._buffer = buf[:len(buf) - keep], buf[len(buf) - keep:]
            if text:
                self.content += text
                events.append(("content", text))
            return False
        if at:
            self.content += buf[:at]
            events.append(("content", buf[:at]))
        self._buffer, self._state = buf[at + len(opening):], "name"
        return True

    def _arguments(self, events: list[tuple]) -> bool:
        call, index = self.calls[-1], len(self.calls) - 1
        for i, c in enumerate(self._buffer):
            if self._scan.step(c):
                fragment, self._buffer = self._buffer[:i + 1], self._buffer[i + 1:]
                call.arguments += fragment
                call.complete = True
                events.append(("arguments", index, fragment))
                self._state = "tail"
                return True
        call.arguments += self._buffer
        events.append(("arguments", index, self._buffer))
        self._buffer = ""
        return False

    def _tail(self) -> bool:
        fmt, buf = self.fmt, self._buffer
        after = fmt.tail + fmt.between
        if buf.startswith(after):
            self._buffer, self._state = buf[len(after):], "name"
            return True
        if not after.startswith(buf) and buf.startswith(fmt.tail):
            self._state = "done"  # the close, or anything after the last call
            return True
        return False
