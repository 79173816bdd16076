"""The FastAPI app factory of ``kvledger serve``.

``create_app(engine, ...)`` wires the pieces: the engine thread (:mod:`.engine_loop`, started
and stopped by the app's lifespan), metrics and the request observer, the routes
(:mod:`.openai.routes`; the dashboard's in :mod:`.dashboard`), the OpenAI-shaped error handlers,
and four ASGI middlewares, outermost
first: with an API key, the key check (401, before any byte of the body is read), the drain
gate (503 once SIGTERM came, :mod:`.lifecycle`), the body limits (413, 408) and the JSON
content type of POST bodies (:mod:`.openai.json_body`). The limits a
user can set are :class:`~kvledger.server.limits.server_limits.ServerLimits`.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from kvledger.errors import ModelNotFoundError
from kvledger.server.auth.middleware import ApiKeyMiddleware
from kvledger.server.auth.tenancy import Tenancy, tenant_of
from kvledger.server.dashboard.routes import router as dashboard_router
from kvledger.server.engine_loop import EngineLoop
from kvledger.server.lifecycle import Drain, DrainMiddleware
from kvledger.server.limits.body import BodyLimitMiddleware
from kvledger.server.limits.server_limits import ServerLimits
from kvledger.server.metrics.observer import RequestObserver
from kvledger.server.metrics.server_metrics import ServerMetrics
from kvledger.server.openai.error_handlers import install_error_handlers
from kvledger.server.openai.json_body import JsonBodyMiddleware
from kvledger.server.openai.routes import router, warm_grammars
from kvledger.server.responses.routes import install_responses_api
from kvledger.server.vllm_compat import VllmCompat, install_vllm_compat


@dataclass
class ServerState:
    """What the routes need: the engine thread, metrics and the model's fixed facts."""

    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    tokenizer: Any
    limits: ServerLimits
    drain: Drain
    grammars: Any = None  # the engine's GrammarCompiler (None: no structured output)
    streams: int = 0  # streamed responses open now (--max-concurrent-streams)

    def check_model(self, model: str | None) -> str:
        """The served model's id; ``None`` means it.

        Raises:
            ModelNotFoundError: ``model`` names another model (HTTP 404).
        """
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(
                f"the model '{model}' does not exist; this server serves '{self.model_name}'"
            )
        return self.model_name


def create_app(engine: Any, *, api_key: str | list[str] | None = None,
               admin_api_key: str | list[str] | None = None,
               share_prefix_cache_across_keys: bool = False,
               max_queue: int | None = None, kv_alert_bytes: int | None = None,
               limits: ServerLimits | None = None, served_model_name: str | None = None,
               log_interval_s: float = 10.0, sessions: Any = None,
               vllm: VllmCompat | None = None) -> FastAPI:
    """Build the server around a loaded engine (an ``LLMEngine`` or an object with its API).

    Args:
        api_key: required as ``Authorization: Bearer KEY`` on every route but ``/health``,
            ``/metrics`` and the OpenAPI documents (:mod:`.auth`); a list accepts any of its
            keys, each one a tenant (:mod:`.auth.tenancy`).
        admin_api_key: keys accepted as well, whose callers see every tenant's requests.
        share_prefix_cache_across_keys: no tenant part in the prefix-cache salt.
        max_queue: most requests waiting for a slot before new ones get 429 (None = no limit).
        kv_alert_bytes: a request whose KV passes this many bytes is logged and counted once.
        limits: body size, timeouts, stop strings, stream slots (default: ServerLimits()).
        log_interval_s: period of the engine status log line (seconds).
        served_model_name: the model id clients send and see (default: the engine's name, the
            model file's stem), as vLLM's ``--served-model-name``.
        sessions: :class:`kvledger.sessions.service.SessionOptions` of the Responses API
            (None: an in-memory state store, the default memory policy).
        vllm: vLLM compatibility options (``--profile-dir``, ``--metrics-compat``); the
            control endpoints of :mod:`.vllm_compat` are always served.
    """
    limits, vllm = limits or ServerLimits(), vllm or VllmCompat()
    model_name = served_model_name or engine.model_name
    metrics = ServerMetrics(model_name, vllm_names=vllm.metrics == "vllm")
    metrics.set_cache_config(engine.cache_config)
    observer = RequestObserver(metrics, kv_alert_bytes, log_interval_s)
    state = ServerState(
        loop=EngineLoop(engine, observer, max_queue), metrics=metrics,
        model_name=model_name, max_model_len=engine.max_model_len,
        tokenizer=engine.tokenizer, limits=limits, drain=Drain(),
        grammars=getattr(engine, "grammars", None),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.grammars is not None:
            await warm_grammars(state.grammars)
        state.loop.start()
        sweeper = asyncio.create_task(app.state.sessions.sweep_forever())
        yield
        sweeper.cancel()
        state.loop.stop()
        app.state.sessions.close()  # after the drain: checkpoints the state DB's WAL

    keys, admins = _keys(api_key), _keys(admin_api_key)
    app = FastAPI(title="kvledger", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.server = state
    app.state.tenancy = Tenancy(keyed=bool(keys or admins),
                                share_prefix_cache=share_prefix_cache_across_keys,
                                admin_tenants=frozenset(map(tenant_of, admins)))
    app.include_router(router)
    app.include_router(dashboard_router)
    install_vllm_compat(app, vllm.profile_dir)
    install_responses_api(app, engine, sessions)
    install_error_handlers(app)
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_bytes=limits.max_body_bytes,
                       timeout_s=limits.body_timeout_s)
    app.add_middleware(DrainMiddleware, drain=state.drain)
    if keys or admins:  # added last: outermost
        app.add_middleware(ApiKeyMiddleware, api_key=keys + admins)
    return app


def _keys(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])
