"""The loop of ``kvledger chat``: read a line, stream the reply, show its KV bill.

The conversation lives on the server (Responses API, ``previous_response_id``); the client
keeps only the id of the last reply. After each answer one dim line shows prompt / cached /
output tokens, TTFT and TPOT as measured here (first and last streamed delta), and the KV
the request held at its peak (server figure). Slash commands: ``/new``, ``/sessions``,
``/load ID``, ``/doc FILE``, ``/memory full|summary|segment``, ``/stats``, ``/quit``.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvledger.sessions.memory import POLICIES

HELP = ("commands: /new  /sessions  /load ID  /doc FILE  /memory full|summary|segment  "
        "/stats  /quit")


def human_bytes(n: float) -> str:
    """``n`` bytes as B / KiB / MiB / GiB with one decimal."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class TurnStats:
    """What the stats line of one answer shows (tokens, seconds, bytes)."""

    prompt: int
    cached: int
    output: int
    ttft_s: float | None
    tpot_s: float | None
    kv_bytes: int
    memory_event: str | None = None

    def line(self) -> str:
        """The dim line printed after an answer."""
        ttft = f"{self.ttft_s * 1000:.0f} ms" if self.ttft_s is not None else "-"
        tpot = f"{self.tpot_s * 1000:.0f} ms" if self.tpot_s is not None else "-"
        event = f" · memory: {self.memory_event}" if self.memory_event else ""
        return (f"prompt {self.prompt} · cached {self.cached} · output {self.output} · "
                f"TTFT {ttft} · TPOT {tpot} · KV {human_bytes(self.kv_bytes)}{event}")


@dataclass
class ChatState:
    """The client side of a chat: the last reply's id and the settings of the next turn."""

    previous_id: str | None = None
    memory: str | None = None
    pending_docs: list[Path] = field(default_factory=list)
    turns: list[TurnStats] = field(default_factory=list)


class ChatRepl:
    """One interactive chat over an ``openai.OpenAI`` client.

    Args:
        client: the openai client (base_url = the server's ``/v1``).
        console: where to print (rich).
        read_line: returns the next input line; raises EOFError at the end.
        history_file: JSON list of the conversations this client started (``--url`` mode);
            None to list the server's with ``GET /v1/sessions`` (local engine).
        max_output_tokens, temperature: of every turn.
    """

    def __init__(self, client, console: Console, read_line: Callable[[str], str],
                 history_file: Path | None, max_output_tokens: int = 256,
                 temperature: float = 0.7, memory: str | None = None) -> None:
        self.client, self.console, self.read_line = client, console, read_line
        self.history_file = history_file
        self.max_output_tokens, self.temperature = max_output_tokens, temperature
        self.state = ChatState(memory=memory)

    def run(self) -> None:
        """Read and answer lines until /quit or the end of input."""
        self.console.print(f"[dim]{HELP}[/dim]")
        while True:
            try:
                line = self.read_line("> ").strip()
            except (EOFError, KeyboardInterrupt):
                return
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return
                continue
            self.ask(line)

    def command(self, line: str) -> bool:
        """Run one slash command; False for /quit."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name == "/quit":
            return False
        if name == "/new":
            self.state.previous_id, self.state.turns = None, []
            self._note("new conversation")
        elif name == "/sessions":
            self._list_sessions()
        elif name == "/load" and arg:
            self._load(arg)
        elif name == "/doc" and arg:
            path = Path(arg).expanduser()
            if path.is_file():
                self.state.pending_docs.append(path)
                self._note(f"{path.name} goes with the next message")
            else:
                self._note(f"no such file: {path}", error=True)
        elif name == "/memory" and arg in POLICIES:
            self.state.memory = arg
            self._note(f"memory policy {arg} (applies when a turn no longer fits)")
        elif name == "/stats":
            self._stats()
        else:
            self._note(HELP, error=True)
        return True

    def _note(self, text: str, error: bool = False) -> None:
        self.console.print(f"[{'red' if error else 'dim'}]{escape(text)}[/]")

    def _input(self, text: str) -> str | list[dict]:
        if not self.state.pending_docs:
            return text
        parts = [{"type": "input_text", "text": text}]
        for path in self.state.pending_docs:
            data = base64.b64encode(path.read_bytes()).decode()
            parts.append({"type": "input_file", "filename": path.name, "file_data": data})
        return [{"role": "user", "content": parts}]

    def ask(self, text: str) -> TurnStats | None:
        """Send one message, stream the answer, print the stats line."""
        import openai

        extra = {"memory": self.state.memory} if self.state.memory else {}
        started = time.perf_counter()
        first = last = None
        final = None
        try:
            stream = self.client.responses.create(
                input=self._input(text), previous_response_id=self.state.previous_id,
                max_output_tokens=self.max_output_tokens, temperature=self.temperature,
                truncation="auto", stream=True, extra_body=extra)
            for event in stream:
                if event.type == "response.output_text.delta":
                    last = time.perf_counter()
                    first = first or last
                    self.console.print(event.delta, end="", markup=False, highlight=False)
                elif event.type in ("response.completed", "response.incomplete"):
                    final = event.response
                elif event.type == "response.failed":
                    self._note(f"\nfailed: {event.response.error.message}", error=True)
        except openai.APIStatusError as exc:
            message = exc.body.get("message") if isinstance(exc.body, dict) else str(exc)
            self._note(f"error {exc.status_code}: {message}", error=True)
            return None
        except openai.APIConnectionError as exc:
            self._note(f"cannot reach the server: {exc}", error=True)
            return None
        self.console.print()
        if final is None:
            return None
        self.state.pending_docs = []
        new_conversation = self.state.previous_id is None
        self.state.previous_id = final.id
        if new_conversation:
            self._remember(final.id)
        stats = self._stats_of(final, started, first, last)
        self.state.turns.append(stats)
        self.console.print(f"[dim]{escape(stats.line())}[/dim]")
        return stats

    @staticmethod
    def _stats_of(final, started: float, first, last) -> TurnStats:
        ext = (final.model_extra or {}).get("kvledger", {})
        usage = final.usage
        n_out = usage.output_tokens
        tpot = (last - first) / (n_out - 1) if first is not None and n_out > 1 else None
        return TurnStats(usage.input_tokens, usage.input_tokens_details.cached_tokens, n_out,
                         first - started if first is not None else None, tpot,
                         ext.get("kv_bytes", 0), ext.get("memory_event"))

    def _remember(self, session_id: str) -> None:
        if self.history_file is None:
            return
        known = self._known()
        known.insert(0, {"id": session_id, "started_at": time.time()})
        self.history_file.parent.mkdir(parents=True, exist_ok=True)
        self.history_file.write_text(json.dumps(known[:100]))

    def _known(self) -> list[dict]:
        try:
            return json.loads(self.history_file.read_text())
        except (OSError, ValueError):
            return []

    def _list_sessions(self) -> None:
        if self.history_file is not None:
            rows = [(s["id"], "") for s in self._known()]
        else:
            listed = self.client.get("/sessions", cast_to=object)
            rows = [(s["id"], f"{s['turns']} turns") for s in listed["data"]]
        if not rows:
            self._note("no conversations yet")
        for session_id, info in rows:
            self.console.print(f"{session_id}  [dim]{info}[/dim]")

    def _load(self, ident: str) -> None:
        import openai

        try:
            listed = self.client.get("/sessions", cast_to=object)["data"]
            match = [s["last_response_id"] for s in listed if s["id"] == ident]
            response_id = match[0] if match else self.client.responses.retrieve(ident).id
        except openai.APIStatusError as exc:
            self._note(f"cannot load {ident}: {exc.status_code}", error=True)
            return
        self.state.previous_id, self.state.turns = response_id, []
        self._note(f"continuing after {response_id}")

    def _stats(self) -> None:
        turns = self.state.turns
        if not turns:
            self._note("no answers in this conversation yet")
            return
        cached = sum(t.cached for t in turns)
        prompt = sum(t.prompt for t in turns)
        self.console.print(
            f"[dim]{len(turns)} answers · last reply {self.state.previous_id} · prompt tokens "
            f"{prompt} (cached {cached}, {100 * cached / max(prompt, 1):.0f}%) · output "
            f"{sum(t.output for t in turns)} · peak KV {human_bytes(max(t.kv_bytes for t in turns))}"
            f" · memory {self.state.memory or 'server default'}[/dim]")
