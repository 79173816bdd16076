"""HTTP routes: /health, /metrics, /v1/models, /tokenize, /v1/completions, /v1/chat/completions.

Generation handlers validate the body (pydantic, -> 400), check the model (-> 404), build the
SamplingParams (-> 400), and add the request through the engine thread, which raises context
and quota errors (-> 400/429) before any byte of a stream is sent. Then they either stream SSE
or wait for the final output, aborting the request if the client leaves.
"""

from __future__ import annotations

import functools
import time
import uuid

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvledger.server.error_handlers import RETRY_AFTER_S, error_response
from kvledger.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    TokenizeRequest,
)
from kvledger.server.responses import ChatFormatter, CompletionFormatter
from kvledger.server.streaming import (
    ClientGone,
    EngineFailure,
    collect,
    engine_error,
    sse_events,
)

# One documented 4xx shape; it also keeps FastAPI from documenting its default 422.
ERRORS = {"4XX": {"model": ErrorResponse, "description": "OpenAI-shaped error (400, 401, 404, "
                  "413, 429 with Retry-After)"}}
router = APIRouter(responses=ERRORS)
STARTED = int(time.time())
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it


def _state(request: Request):
    return request.app.state.server


def _model_card(state) -> dict:
    return {"id": state.model_name, "object": "model", "created": STARTED,
            "owned_by": "kvledger", "max_model_len": state.max_model_len}


@router.get("/health")
async def health(request: Request):
    """200 while the engine thread runs, else 503."""
    if not _state(request).loop.alive:
        return error_response(503, "the engine thread has stopped", "engine_dead")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition (metric names under ``kvledger:``)."""
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    """The served model, with its context limit ``max_model_len`` (tokens)."""
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    """One model card; 404 for any other id."""
    state = _state(request)
    state.check_model(model_id)
    return _model_card(state)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """Token ids of a prompt or of chat messages (with the generation prompt)."""
    state = _state(request)
    state.check_model(body.model)
    engine_input = body.engine_input()
    tokens = await state.loop.call(lambda engine: engine.tokenize(engine_input))
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completion, streamed or not."""
    return await _generate(request, body, body.prompt, CompletionFormatter, "cmpl",
                           logprobs=body.logprobs is not None)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completion (the model's chat template), streamed or not."""
    return await _generate(request, body, body.template_messages(), ChatFormatter, "chatcmpl",
                           logprobs=body.logprobs)


async def _generate(request: Request, body, prompt, formatter_cls, id_prefix: str,
                    logprobs: bool):
    state = _state(request)
    model = state.check_model(body.model)
    params = body.sampling_params()
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    outputs = await state.loop.add(request_id, prompt, params)
    abort = functools.partial(state.loop.abort, request_id)
    formatter = formatter_cls(request_id, model, state.tokenizer, logprobs)
    if body.stream:
        events = sse_events(outputs, formatter, body.include_usage, abort)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    try:
        final, token_logprobs = await collect(outputs, request, abort)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except EngineFailure as exc:
        status, error = engine_error(exc.args[0])
        headers = {"Retry-After": RETRY_AFTER_S} if status == 429 else None
        return JSONResponse(error, status_code=status, headers=headers)
    return formatter.response(final, token_logprobs)
