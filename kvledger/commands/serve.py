"""``kvledger serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn), loopback by default.

Heavy imports (torch through the engine, fastapi, uvicorn) happen inside the function so that
``kvledger plan`` starts without them.
"""

from __future__ import annotations

from typing import Annotated

import typer

from kvledger.commands.engine_options import engine_options
from kvledger.engine.config import EngineConfig

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@engine_options()
def serve(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    api_key: Annotated[list[str] | None, typer.Option(
        help="Require 'Authorization: Bearer KEY' on /v1 routes and /tokenize; repeat for "
             "several keys (each a tenant of the Responses API).")] = None,
    api_keys_file: Annotated[str | None, typer.Option(
        help="A file with more API keys: one key per line, the whole line trimmed; blank "
             "lines and lines starting with '#' are comments (so no key starts with '#'). A "
             "file with no key is refused.")] = None,
    admin_api_key: Annotated[list[str] | None, typer.Option(
        help="A key accepted like --api-key whose caller also sees every tenant's requests "
             "on the dashboard; repeat for several.")] = None,
    share_prefix_cache_across_keys: Annotated[bool, typer.Option(
        help="Let requests of different API keys hit each other's prefix cache (by default "
             "each key's prompts are salted apart).")] = False,
    state_db: Annotated[str | None, typer.Option(
        help="SQLite file of the Responses API's conversations (default: in the user data "
             "folder).")] = None,
    state_max_age: Annotated[str | None, typer.Option(
        help="Delete conversations not continued for this long (seconds, or 90m, 12h, "
             "30d).")] = None,
    state_max_gib: Annotated[float | None, typer.Option(
        help="Keep the state DB under this size (GiB): the least recently continued "
             "conversations are deleted first.")] = None,
    state_quota_mib: Annotated[float | None, typer.Option(
        help="Most MiB of stored conversations per API key; at the quota a stored turn gets "
             "HTTP 403.")] = None,
    memory: Annotated[str, typer.Option(
        help="Memory policy of conversations under truncation='auto': full, summary or "
             "segment.")] = "summary",
    segment_turns: Annotated[int, typer.Option(
        help="With --memory segment: turns per segment.")] = 8,
    max_queue: Annotated[int | None, typer.Option(
        help="Most requests waiting for a slot; more get HTTP 429.")] = None,
    kv_alert_bytes: Annotated[int | None, typer.Option(
        help="Log a warning and count kv_alerts when a request's KV passes this many bytes.")]
    = None,
    log_interval_s: Annotated[float, typer.Option(
        help="Seconds between engine status log lines.")] = 10.0,
    max_body_bytes: Annotated[int, typer.Option(
        help="Largest request body (bytes); larger: HTTP 413.")] = 4 << 20,
    body_timeout_s: Annotated[float, typer.Option(
        help="Most seconds for a request body to arrive; later: HTTP 408.")] = 30.0,
    header_timeout_s: Annotated[float, typer.Option(
        help="Most seconds for request headers to arrive; later: connection closed.")] = 10.0,
    max_header_bytes: Annotated[int, typer.Option(
        help="Largest request header block (bytes); larger: HTTP 431.")] = 64 << 10,
    request_timeout_s: Annotated[float | None, typer.Option(
        help="Abort a request running longer than this (HTTP 504 request_timeout).")] = None,
    max_concurrent_streams: Annotated[int | None, typer.Option(
        help="Most streamed responses open at once; more: HTTP 429.")] = None,
    max_input_chars: Annotated[int, typer.Option(
        help="Most characters in a request's input (prompt, messages, input, instructions), "
             "counted before tokenizing; more: HTTP 400.")] = 1_000_000,
    max_input_items: Annotated[int, typer.Option(
        help="Most messages, content parts, prompts and input items in one request; more: "
             "HTTP 400.")] = 4096,
    max_stop_strings: Annotated[int, typer.Option(
        help="Most 'stop' strings per request; more: HTTP 400.")] = 16,
    max_stop_chars: Annotated[int, typer.Option(
        help="Longest 'stop' string (characters); longer: HTTP 400.")] = 256,
    max_tools: Annotated[int, typer.Option(
        help="Most tools in one request; more: HTTP 400.")] = 128,
    max_prompt_logprob_entries: Annotated[int, typer.Option(
        help="Most prompt-logprob entries of one request: its prompt tokens x "
             "(prompt_logprobs + 1); more: HTTP 400.")] = 1_000_000,
    send_timeout_s: Annotated[float, typer.Option(
        help="Drop a streaming client that reads nothing for this long.")] = 30.0,
    served_model_name: Annotated[str | None, typer.Option(
        help="Model id clients send and see (default: the model file's stem).")] = None,
    chat_template: Annotated[str | None, typer.Option(
        help="A Jinja chat template file used instead of the model's own (GGUF metadata or "
             "tokenizer_config.json).")] = None,
    drain_timeout_s: Annotated[float, typer.Option(
        help="On SIGTERM, seconds in-flight requests get to finish before exit.")] = 30.0,
    trace: Annotated[str | None, typer.Option(
        help="Record every request and engine step to this file (JSON lines, for `kvledger "
             "replay`).")] = None,
    trace_private: Annotated[bool, typer.Option(
        help="With --trace: record prompt lengths and block hashes instead of token ids.")]
    = False,
    profile_dir: Annotated[str | None, typer.Option(
        help="Folder where POST /start_profile and /stop_profile write torch profiler traces "
             "(vLLM's profiler endpoints; off without it).")] = None,
    metrics_compat: Annotated[str | None, typer.Option(
        help="'vllm': /metrics also exposes every metric that has a vLLM counterpart under "
             "vLLM's name and labels (docs/vllm-compat.md).")] = None,
    *,
    engine_config: EngineConfig,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/responses,
    /v1/models), /tokenize, /detokenize, /health, /version, Prometheus /metrics, vLLM's
    /reset_prefix_cache, /start_profile and /stop_profile, and the live dashboard
    (/dashboard)."""
    _check_options(host, port, max_queue, kv_alert_bytes, trace)
    from kvledger.server.auth.api_keys import read_api_keys
    from kvledger.server.limits.server_limits import ServerLimits
    from kvledger.sessions.options import session_options
    from kvledger.sessions.store import SessionStore

    vllm = _vllm_options(profile_dir, metrics_compat)
    template = _read_chat_template(chat_template)

    api_keys = read_api_keys(api_key or [], api_keys_file, admin_api_key)
    sessions = session_options(state_db, memory, segment_turns, state_max_age, state_max_gib,
                               state_quota_mib)
    SessionStore(sessions.state_db).close()  # refuse a bad state DB before loading the model

    limits = ServerLimits(
        max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s,
        header_timeout_s=header_timeout_s, max_header_bytes=max_header_bytes,
        max_input_chars=max_input_chars, max_input_items=max_input_items,
        max_stop_strings=max_stop_strings, max_stop_chars=max_stop_chars, max_tools=max_tools,
        max_prompt_logprob_entries=max_prompt_logprob_entries,
        max_concurrent_streams=max_concurrent_streams, request_timeout_s=request_timeout_s,
        send_timeout_s=send_timeout_s, drain_timeout_s=drain_timeout_s)
    import logging

    from kvledger.engine.engine import LLMEngine
    from kvledger.server.app import create_app
    from kvledger.server.heap_trim import tune_malloc
    from kvledger.server.lifecycle import DrainingServer
    from kvledger.server.limits.connection import uvicorn_config

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvledger.server").info("malloc settings: %s", tune_malloc() or "as set")
    engine = LLMEngine(engine_config)
    if template is not None:
        engine.tokenizer.chat_template = template
    if trace is not None:
        engine = _traced(engine, engine_config, trace, trace_private)
    app = create_app(engine, api_key=list(api_keys.keys),
                     admin_api_key=list(api_keys.admin_keys),
                     share_prefix_cache_across_keys=share_prefix_cache_across_keys,
                     max_queue=max_queue,
                     kv_alert_bytes=kv_alert_bytes, limits=limits, log_interval_s=log_interval_s,
                     served_model_name=served_model_name, sessions=sessions, vllm=vllm)
    log = logging.getLogger("kvledger.server")
    log.info("serving %s (max_model_len %d) on http://%s:%d (dashboard: /dashboard)",
             app.state.server.model_name, engine.max_model_len, host, port)
    log.info("conversations (Responses API) in %s, memory policy %s", sessions.state_db,
             sessions.memory)
    log.info("authentication: %s", api_keys.describe())
    if host not in LOOPBACK and not (api_keys.keys or api_keys.admin_keys):
        log.warning("listening on %s without --api-key: anyone who can reach it may use it", host)
    config = uvicorn_config(app, host, port, limits)
    state = app.state.server
    DrainingServer(config, state.drain, drain_timeout_s, state.loop.stop).run()


def _traced(engine, config: EngineConfig, path: str, private: bool):
    """The engine wrapped to record a trace (kvledger/replay/trace.py) into ``path``."""
    import dataclasses

    from kvledger.replay.recorder import TracingEngine
    from kvledger.replay.trace import TraceWriter

    try:
        writer = TraceWriter(path, "serve", engine.model_name, private, config.block_size,
                             dataclasses.asdict(config), engine.snapshot().pool.blocks_total)
    except OSError as exc:
        from kvledger.errors import InvalidParameterError

        raise InvalidParameterError(f"--trace: cannot write {path}: {exc.strerror}") from None
    return TracingEngine(engine, writer)


def _vllm_options(profile_dir: str | None, metrics_compat: str | None):
    """The vLLM options, checked before the model loads: a profile folder is created if
    missing and must be writable; ``--metrics-compat`` takes ``vllm`` only."""
    import os
    from pathlib import Path

    from kvledger.errors import InvalidParameterError
    from kvledger.server.vllm_compat import VllmCompat

    if metrics_compat not in (None, "vllm"):
        raise InvalidParameterError(f"--metrics-compat takes 'vllm', got {metrics_compat!r}")
    if profile_dir is not None:
        try:
            Path(profile_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidParameterError(f"--profile-dir: cannot create {profile_dir}: "
                                        f"{exc.strerror}") from None
        if not os.access(profile_dir, os.W_OK):
            raise InvalidParameterError(f"--profile-dir: cannot write in {profile_dir}")
    return VllmCompat(profile_dir, metrics_compat)


def _read_chat_template(path: str | None) -> str | None:
    """The text of ``--chat-template`` (before the model loads).

    Raises:
        InvalidParameterError: the file cannot be read or is empty (exit 2).
    """
    from pathlib import Path

    from kvledger.errors import InvalidParameterError

    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidParameterError(f"--chat-template: cannot read {path}: {exc}") from None
    if not text.strip():
        raise InvalidParameterError(f"--chat-template: {path} is empty")
    return text


def _check_options(host: str, port: int, max_queue: int | None,
                   kv_alert_bytes: int | None, trace: str | None = None) -> None:
    """One-line errors (exit 2) for options uvicorn would only fail on with a traceback, and
    for a ``--trace`` folder that does not exist or cannot be written (before the model loads)."""
    import os
    import socket
    from pathlib import Path

    from kvledger.errors import InvalidParameterError

    if trace is not None:
        folder = Path(trace).parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise InvalidParameterError(f"--trace: cannot write {trace}: no writable folder "
                                        f"{str(folder)!r}")

    if not 0 < port < 65536:
        raise InvalidParameterError(f"--port must be in 1..65535, got {port}")
    for name, value in (("--max-queue", max_queue), ("--kv-alert-bytes", kv_alert_bytes)):
        if value is not None and value < 1:
            raise InvalidParameterError(f"{name} must be >= 1, got {value}")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise InvalidParameterError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
