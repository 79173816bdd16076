"""The FastAPI app factory of ``kvledger serve``.

``create_app(engine, ...)`` wires the pieces: the engine thread (:mod:`.engine_loop`, started
and stopped by the app's lifespan), metrics and the request observer, the routes
(:mod:`.routes`), the OpenAI-shaped error handlers, and two ASGI middlewares, outermost first:
the body-size cap (413) and, with an API key, the key check (401).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from kvledger.errors import ModelNotFoundError
from kvledger.server.auth import ApiKeyMiddleware
from kvledger.server.body_limit import BodyLimitMiddleware
from kvledger.server.engine_loop import EngineLoop
from kvledger.server.error_handlers import install_error_handlers
from kvledger.server.metrics import ServerMetrics
from kvledger.server.observer import RequestObserver
from kvledger.server.routes import router

DEFAULT_MAX_BODY_BYTES = 4 << 20


@dataclass
class ServerState:
    """What the routes need: the engine thread, metrics and the model's fixed facts."""

    loop: EngineLoop
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    tokenizer: Any

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


def create_app(engine: Any, *, api_key: str | None = None, max_queue: int | None = None,
               kv_alert_bytes: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               log_interval_s: float = 10.0) -> FastAPI:
    """Build the server around a loaded engine (an ``LLMEngine`` or an object with its API).

    Args:
        api_key: required as ``Authorization: Bearer KEY`` on ``/v1`` and ``/tokenize``.
        max_queue: most requests waiting for a slot before new ones get 429 (None = no limit).
        kv_alert_bytes: a request whose KV passes this many bytes is logged and counted once.
        max_body_bytes: largest accepted request body (bytes); larger ones get 413.
        log_interval_s: period of the engine status log line (seconds).
    """
    metrics = ServerMetrics(engine.model_name)
    observer = RequestObserver(metrics, kv_alert_bytes, log_interval_s)
    state = ServerState(
        loop=EngineLoop(engine, observer, max_queue), metrics=metrics,
        model_name=engine.model_name, max_model_len=engine.max_model_len,
        tokenizer=engine.tokenizer,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop.start()
        yield
        state.loop.stop()

    app = FastAPI(title="kvledger", summary="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.server = state
    app.include_router(router)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    return app
