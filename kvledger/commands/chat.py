"""``kvledger chat``: an interactive terminal chat on server-side conversations.

With ``--url`` it talks to a running ``kvledger serve``; without, it starts the same server
in this process (loopback, a free port) on the local engine and the same state DB, so the
conversations of both are one store. Line editing and history (arrow keys) come from the
standard ``readline`` module where the platform has it.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

SERVER_START_TIMEOUT_S = 60.0


def chat(
    url: Annotated[str | None, typer.Option(
        help="Base URL of a running kvledger server (e.g. http://127.0.0.1:8000); default: "
             "start the local engine in this process.")] = None,
    api_key: Annotated[str | None, typer.Option(help="API key sent as a Bearer token.")]
    = None,
    model: Annotated[str, typer.Option(help="Local engine: 'default', a GGUF file or an HF "
                                            "folder.")] = "default",
    dtype: Annotated[str, typer.Option(help="Local engine: bf16 (fast) or fp32 (exact).")] = "bf16",
    state_db: Annotated[str | None, typer.Option(
        help="Local engine: SQLite file of the conversations (default: the user data "
             "folder, shared with kvledger serve).")] = None,
    memory: Annotated[str, typer.Option(
        help="Memory policy: full, summary or segment.")] = "summary",
    max_kv_tokens_per_request: Annotated[int | None, typer.Option(
        help="Local engine: per-request KV quota in tokens (the memory budget).")] = None,
    max_output_tokens: Annotated[int, typer.Option(help="Most tokens per answer.")] = 256,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0 = greedy).")]
    = 0.7,
    doc: Annotated[list[Path] | None, typer.Option(
        help="Text file(s) attached to the first message (retrieve-then-stitch).")] = None,
) -> None:
    """Chat in the terminal; each answer is followed by its token and KV figures."""
    import openai
    from rich.console import Console

    from kvledger.errors import InvalidParameterError
    from kvledger.sessions.chat_repl import ChatRepl
    from kvledger.sessions.options import default_state_db, session_options

    options = session_options(state_db, memory, segment_turns=8)
    if max_output_tokens < 1:
        raise InvalidParameterError(f"--max-output-tokens must be >= 1, got {max_output_tokens}")
    for path in doc or []:
        if not path.is_file():
            raise InvalidParameterError(f"--doc {path}: no such file")
    console = Console(highlight=False)
    history = None
    if url is None:
        console.print(f"[dim]loading {model} ...[/dim]")
        url = _start_local_server(model, dtype, options, max_kv_tokens_per_request)
    else:
        history = default_state_db().parent / "chat_sessions.json"
    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none",
                           max_retries=0)
    repl = ChatRepl(client, console, _line_reader(console), history, max_output_tokens,
                    temperature, memory)
    repl.state.pending_docs = list(doc or [])
    repl.run()


def _line_reader(console):
    try:
        import readline  # noqa: F401 - importing it gives input() line editing and history
    except ImportError:
        pass
    return console.input


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_local_server(model: str, dtype: str, options, quota: int | None) -> str:
    """Load the engine and serve it on a loopback port in a daemon thread; its base URL."""
    import uvicorn

    from kvledger.engine.config import EngineConfig
    from kvledger.engine.engine import LLMEngine
    from kvledger.errors import InvalidParameterError
    from kvledger.server.app import create_app
    from kvledger.sessions.store import SessionStore

    SessionStore(options.state_db).close()  # a bad state DB is refused before the model loads
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, max_kv_tokens_per_request=quota))
    app = create_app(engine, sessions=options)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, name="kvledger-chat-server", daemon=True).start()
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline:
            raise InvalidParameterError("the local server did not start")
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}"
