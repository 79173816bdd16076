"""vLLM's control endpoints, for the tools written against a vLLM server (aiperf, lm-eval).

- ``POST /reset_prefix_cache``: drops every evictable prefix-cache block; blocks in use keep
  their entries (so it always succeeds, unlike vLLM's, which refuses while blocks are held).
  Answer: ``{"success": true, "evicted_blocks": N}``.
- ``POST /start_profile``, ``POST /stop_profile``: a ``torch.profiler`` trace of the engine
  thread, written at stop as a Chrome trace (``kvledger-<time in ns>.pt.trace.json``) under
  ``--profile-dir``; without that option both are 404 naming it (vLLM has no such route then),
  a second start or a stop without a start is 409.
- ``POST /detokenize`` (``{"tokens": [...]}`` -> ``{"prompt": text}``), ``GET
  /tokenizer_info`` (special tokens and chat template: with ``/tokenize`` and
  ``/detokenize``, lm-eval's remote tokenizer), ``GET /version``.

With API keys set, every route here needs a valid key (:mod:`.auth`), and the three control
routes (reset, start, stop) an ``--admin-api-key`` (403 for a tenant's key): they act on every
tenant's cache and steps. Sources: vLLM's
``entrypoints/openai/api_server.py`` (routes and bodies), aiperf's ``--reset-kv-cache`` and
``--server-profiler``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from kvledger import __version__
from kvledger.errors import InvalidParameterError, KVLedgerError
from kvledger.server.auth.tenancy import caller
from kvledger.server.detokenize_body import parse_detokenize_body
from kvledger.server.openai.protocol import DetokenizeRequest
from kvledger.server.tokenizer_thread import decode

log = logging.getLogger("kvledger.server")
router = APIRouter()


class ProfilerOffError(KVLedgerError):
    """``/start_profile`` or ``/stop_profile`` on a server started without ``--profile-dir``."""

    http_status = 404
    code = "profiler_disabled"


class AdminOnlyError(KVLedgerError):
    """A control route called with a tenant's key on a server with API keys."""

    http_status = 403
    code = "admin_only"


class ProfilerStateError(KVLedgerError):
    """A start while a profile runs, or a stop while none does (HTTP 409)."""

    http_status = 409
    code = "profiler_state"


@dataclass(frozen=True)
class VllmCompat:
    """``kvledger serve``'s vLLM options: ``profile_dir`` (``--profile-dir``: where
    ``/stop_profile`` writes traces; None: the profiler routes are off) and ``metrics``
    (``--metrics-compat``: ``vllm`` adds vLLM's metric names; None: ours only)."""

    profile_dir: str | None = None
    metrics: str | None = None


@dataclass
class Profiler:
    """The torch profiler of the engine thread; ``folder`` None: profiling is off."""

    folder: Path | None
    running: object = None  # the torch.profiler.profile while one records

    def start(self) -> None:
        """Start recording in the calling thread (the engine thread)."""
        import torch.profiler

        self.running = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                              record_shapes=True)
        self.running.start()

    def stop(self):
        """Stop recording in the calling thread; the stopped profile, to export."""
        profile, self.running = self.running, None
        profile.stop()
        return profile


def init_kineto() -> None:
    """Initialise kineto, torch's profiler backend, in the calling thread with one empty
    profile. Kineto registers its client in the thread that loads torch and initialises it
    when a profile first starts; started first in another thread (the engine thread), it
    prints ``ERROR: External init callback must run in same thread as registerClient``."""
    profiler = Profiler(None)
    profiler.start()
    profiler.stop()


def install_vllm_compat(app: FastAPI, profile_dir: str | None) -> None:
    """Add the routes above to ``app``; ``profile_dir`` turns the profiler routes on (and
    initialises kineto here, in the thread that builds the app: the one that loaded torch)."""
    app.state.profiler = Profiler(None if profile_dir is None else Path(profile_dir))
    if profile_dir is not None:
        init_kineto()
    app.include_router(router)


def _require_admin(request: Request) -> None:
    if not caller(request).admin:
        raise AdminOnlyError(f"{request.url.path} acts on every tenant: it needs an "
                             "--admin-api-key")


def _profiler(request: Request) -> Profiler:
    _require_admin(request)
    profiler = request.app.state.profiler
    if profiler.folder is None:
        raise ProfilerOffError("the profiler is off: start the server with --profile-dir DIR "
                               "to record torch profiler traces there")
    return profiler


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    """Drop every tenant's evictable prefix-cache blocks (blocks in use keep theirs)."""
    _require_admin(request)
    evicted = await request.app.state.server.loop.call(lambda e: e.reset_prefix_cache())
    log.info("prefix cache reset: %d evictable blocks dropped", evicted)
    return {"success": True, "evicted_blocks": evicted}


@router.post("/start_profile")
async def start_profile(request: Request) -> dict:
    """Start a torch profiler trace of the engine thread (needs ``--profile-dir``)."""
    profiler = _profiler(request)
    if profiler.running is not None:
        raise ProfilerStateError("a profile is already running: POST /stop_profile first")
    await request.app.state.server.loop.call(lambda _: profiler.start())
    log.info("profiler started")
    return {"profiling": True}


@router.post("/stop_profile")
async def stop_profile(request: Request) -> dict:
    """Stop the trace and write it under ``--profile-dir``; the answer names the file."""
    profiler = _profiler(request)
    if profiler.running is None:
        raise ProfilerStateError("no profile is running: POST /start_profile first")
    profile = await request.app.state.server.loop.call(lambda _: profiler.stop())
    path = profiler.folder / f"kvledger-{time.time_ns()}.pt.trace.json"
    await asyncio.to_thread(profile.export_chrome_trace, str(path))
    log.info("profiler trace written to %s", path)
    return {"profiling": False, "trace": str(path)}


@router.post("/detokenize", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": DetokenizeRequest.model_json_schema()}}}})
async def detokenize(request: Request) -> JSONResponse:
    """The text of token ids (ids outside the vocabulary: 400). The body is parsed and checked,
    the ids decoded and the answer serialised in the tokenizer thread (1.5 M ids)."""
    state = request.app.state.server
    body = await state.loop.tokenizer_thread.run(parse_detokenize_body,
                                               await request.body())
    state.check_model(body.model)
    if state.tokenizer is None:
        raise InvalidParameterError("this model has no tokenizer")
    ids = await state.loop.tokenize(body.tokens)  # checks the ids against the vocabulary
    return await state.loop.tokenizer_thread.run(_detokenized, state.tokenizer, ids)


def _detokenized(tokenizer, ids: list[int]) -> JSONResponse:
    """The answer, decoded and serialised in the tokenizer thread (megabytes of text)."""
    return JSONResponse({"prompt": decode(tokenizer, ids)})


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict:
    """The tokenizer's special tokens and chat template (what lm-eval's remote tokenizer
    reads, with ``/tokenize`` and ``/detokenize``)."""
    state = request.app.state.server
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise InvalidParameterError("this model has no tokenizer")
    info = {name: getattr(tokenizer, name, None)
            for name in ("eos_token", "bos_token", "pad_token", "chat_template")}
    return {"tokenizer_class": type(tokenizer).__name__, **info,
            "model_max_length": state.max_model_len}


@router.get("/version")
async def version() -> dict:
    """The server's version."""
    return {"version": __version__}
