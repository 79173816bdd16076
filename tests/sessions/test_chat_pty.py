"""``kvledger chat`` in a pseudo-terminal: readline line editing and history with arrow keys.

Stdin-fed tests (``test_chat.py``) never see a terminal, so readline is inactive there. Here
the chat runs on a pty against a served fake engine; the Up arrow recalls the last message,
which is sent again and continues the same conversation on the server.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

import pytest

pty = pytest.importorskip("pty")

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")
UP = "\x1b[A"


class Terminal:
    """A child process on a pty; ``expect`` reads its output (ANSI codes stripped)."""

    def __init__(self, argv: list[str], env: dict) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True)
        os.close(slave)
        self.text = ""

    def expect(self, needle: str, count: int = 1, timeout_s: float = 60.0) -> str:
        """Read until ``needle`` has appeared ``count`` times; the output so far."""
        deadline = time.monotonic() + timeout_s
        while self.text.count(needle) < count:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"no {needle!r} (x{count}) in the output:\n{self.text}")
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the child closed the pty
                    chunk = b""
                self.text += ANSI.sub("", chunk.decode("utf-8", "replace"))
        return self.text

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=30)
        finally:
            os.close(self.master)


def test_up_arrow_resends_the_last_message_in_the_same_conversation(served, tmp_path):
    url, app = served
    env = {**os.environ, "KVLEDGER_DATA_DIR": str(tmp_path), "COLUMNS": "200",
           "TERM": "xterm", "INPUTRC": os.devnull}
    term = Terminal([sys.executable, "-m", "kvledger.cli", "chat", "--url", url,
                     "--temperature", "0"], env)
    try:
        term.expect("> ")
        term.send("Hello there\r")
        term.expect("· cached 0 ·")
        term.send(UP + "\r")  # readline's history: the same line again
        out = term.expect("· TTFT", count=2)
        term.send("/quit\r")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
    first, second = (int(n) for n in re.findall(r"prompt (\d+) · cached", out))
    assert second > first  # the second turn's prompt holds the first turn
    (session,) = app.state.sessions.store.sessions("")
    assert session.turns == 2
    last = app.state.sessions.store.get_response("", session.last_response_id)
    prompt = "".join(map(chr, last.token_ids[: last.prompt_len]))
    assert prompt.count("<|user|>Hello there<|end|>") == 2
