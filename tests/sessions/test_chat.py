"""``kvledger chat --url`` driven through stdin against a served fake engine."""

from __future__ import annotations

import os
import subprocess
import sys

from fake_engine import TEXT


def _chat(url: str, lines: list[str], data_dir) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVLEDGER_DATA_DIR": str(data_dir), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "kvledger.cli", "chat", "--url", url,
                           "--temperature", "0"], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=120, env=env, check=False)


def test_chat_session_commands_and_stats(served, tmp_path):
    url, app = served
    doc = tmp_path / "notes.txt"
    doc.write_text("The harbour master is called Oskar Lind and he likes tea.")
    done = _chat(url, ["Hello there", "/stats", f"/doc {doc}", "Who is the harbour master?",
                       "/memory segment", "/sessions", "/new", "Fresh start", "/quit",
                       "never read"], tmp_path)
    out = done.stdout
    assert done.returncode == 0, done.stderr
    assert out.count(TEXT) == 3
    first_prompt = len("<|system|>You are a fake.<|end|>\n<|user|>Hello there<|end|>\n"
                       "<|assistant|>")
    assert f"prompt {first_prompt} · cached 0 · output {len(TEXT)} · TTFT" in out
    assert "1 answers" in out and "notes.txt goes with the next message" in out
    assert "memory policy segment" in out
    sessions = app.state.sessions.store.sessions("")
    assert len(sessions) == 2 and sorted(s.turns for s in sessions) == [1, 2]
    assert [s.session_id for s in sessions][1] in out  # /sessions listed the first one
    chunks = app.state.sessions.store.chunks("", sessions[1].session_id)
    assert [c.source for c in chunks] == ["notes.txt"]
    assert "never read" not in out


def test_chat_load_continues_a_conversation(served, tmp_path):
    url, app = served
    _chat(url, ["First"], tmp_path)
    (session,) = app.state.sessions.store.sessions("")
    done = _chat(url, [f"/load {session.session_id}", "Second"], tmp_path)
    assert f"continuing after {session.last_response_id}" in done.stdout
    (session,) = app.state.sessions.store.sessions("")
    assert session.turns == 2


def test_chat_unreachable_server_is_one_line(tmp_path):
    done = _chat("http://127.0.0.1:9", ["hi"], tmp_path)
    assert done.returncode == 0 and "cannot reach the server" in done.stdout
    assert "Traceback" not in done.stderr
