"""Routes of the OpenAI Responses API: server-side conversations.

``POST /v1/responses`` (streamed or not), ``GET`` / ``DELETE /v1/responses/{id}``, and
kvledger's ``GET /v1/sessions`` (the caller's conversations, for ``kvledger chat``). Every
route sees only the caller's tenant (:mod:`kvledger.server.auth.tenancy`), whose prefix-cache
salt its turns and their memory requests carry.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvledger.errors import InvalidParameterError
from kvledger.server.auth.tenancy import caller
from kvledger.server.limits.input_size import bind_input_limits
from kvledger.server.openai.error_handlers import RETRY_AFTER_S
from kvledger.server.openai.routes import (
    CLIENT_CLOSED_REQUEST,
    ERRORS,
    _check_request,
    _warn_unknown,
    compile_output,
    request_field,
)
from kvledger.server.openai.streaming import (
    ClientGone,
    EngineFailure,
    EngineStream,
    RequestTimedOut,
    collect,
    engine_error,
    timeout_error,
)
from kvledger.server.responses.protocol import ResponseBuilder, ResponsesRequest
from kvledger.server.responses.session_metrics import SessionMetrics
from kvledger.server.tools.formats import HERMES, hermes_system_text
from kvledger.server.tools.plan import output_constraint, plan_tools, template_messages
from kvledger.sessions.errors import StateStoreUnavailableError
from kvledger.sessions.retrieval import decode_document
from kvledger.sessions.service import SessionOptions, SessionService, TurnInput
from kvledger.sessions.store import SessionStore

router = APIRouter(responses=ERRORS, dependencies=[Depends(bind_input_limits)])
DEFAULT_BLOCK_SIZE = 16  # an engine without a scheduler budget (test fakes) pads to this


def install_responses_api(app: FastAPI, engine, options: SessionOptions | None) -> None:
    """Open the state store and add the routes to ``app`` (whose ``state.server`` is set).

    Raises:
        StateStoreError: the state DB cannot be used (corrupt, locked, newer schema).
    """
    server = app.state.server
    # the ledger's admission rule (kvledger.ledger.admission): context, pool and KV quota
    budget = getattr(getattr(engine, "scheduler", None), "budget", None)
    limit = budget.max_total_tokens if budget else server.max_model_len
    options = options or SessionOptions()
    store = SessionStore(options.state_db)
    app.state.sessions = SessionService(
        server.loop, store, limit, budget.block_size if budget else DEFAULT_BLOCK_SIZE,
        options, SessionMetrics(server.metrics.registry, server.model_name))
    store.delete_orphans()  # documents of turns a crash cut off
    app.state.sessions.expire()
    app.include_router(router)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    """Answer one turn; continue a stored conversation with ``previous_response_id``."""
    server, service = request.app.state.server, request.app.state.sessions
    body.check_supported()
    _warn_unknown(body, request)
    model = server.check_model(body.model)
    _check_request(server, body)
    body.check_include()
    who = caller(request)
    items = body.turn(_previous_calls(service, who.tenant, body.previous_response_id))
    documents = [(name, decode_document(data, name, service.options.max_document_bytes))
                 for name, data in items.documents]
    instructions = "\n\n".join(filter(None, (body.instructions, items.system))) or None
    messages = (template_messages(items.messages, None, server.tokenizer, model)[0]
                if items.messages else None)
    params = body._sampling(None, None)
    streaming = body.stream  # count the slot before the first await, so the cap holds
    if streaming:
        server.streams += 1
    try:
        tools = await _structured_output(server, body, model, params, who.tenant)
        turn_input = TurnInput(items.text, documents, instructions, body.previous_response_id,
                               params, body.max_output_tokens, body.truncation or "disabled",
                               body.memory, body.store,
                               hermes_system_text(tools.declarations()) if tools else None,
                               messages)
        turn = await service.start(who.tenant, who.cache_salt(body.cache_salt), turn_input)
    except BaseException:
        if streaming:
            server.streams -= 1
        raise
    builder = ResponseBuilder(turn.response_id, model, body, service.describe(turn), tools)
    timeout_s = server.limits.request_timeout_s

    def abort() -> None:
        server.loop.abort(turn.response_id)

    if streaming:
        def close() -> None:
            abort()
            service.cancel(turn)
            server.streams -= 1

        return EngineStream(_events(service, turn, builder, timeout_s), close,
                            server.limits.send_timeout_s)
    try:
        final = (await collect(turn.outputs, request, abort, 1, timeout_s))[turn.response_id][0]
    except ClientGone:
        service.cancel(turn)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except RequestTimedOut:  # the same request would time out again: no Retry-After
        service.cancel(turn)
        return JSONResponse(timeout_error(timeout_s), status_code=504)
    except EngineFailure as exc:
        service.cancel(turn)
        status, error = engine_error(exc.args[0])
        headers = {"Retry-After": RETRY_AFTER_S} if status == 429 else None
        return JSONResponse(error, status_code=status, headers=headers)
    except BaseException:
        service.cancel(turn)
        raise
    obj = builder.response(final)
    service.finish(turn, final, obj)
    return obj


def _previous_calls(service: SessionService, tenant: str, previous_response_id: str | None
                    ) -> set[str] | None:
    """The ``call_id`` of each function call of the previous response (None without one): a
    ``function_call_output`` answers one of them or a ``function_call`` of the same input.

    Raises:
        ResponseNotFoundError: no such previous response (HTTP 404).
    """
    if previous_response_id is None:
        return None
    output = service.get(tenant, previous_response_id).body.get("output", [])
    return {item.get("call_id") for item in output if item.get("type") == "function_call"}


async def _structured_output(server, body: ResponsesRequest, model: str, params,
                             tenant: str | None):
    """The turn's tool plan (None when no call can come back); ``params.structured_outputs``
    is set from ``text.format`` and the tools, and compiled.

    Raises:
        InvalidParameterError, UnsupportedParameterError: a bad format or tool choice, or
            tools for a model whose template writes calls in another format than Hermes
            (a conversation's system turn declares tools in Hermes' layout).
    """
    text_format = body.text.format if body.text else None
    schema = text_format.schema() if text_format is not None else None
    plan = plan_tools([t.function() for t in body.tools or []], body.tool_choice,
                      body.parallel_tool_calls, schema, server.tokenizer, model)
    if plan is not None and plan.fmt is not HERMES:
        raise InvalidParameterError(
            f"tools on /v1/responses need a model that writes Hermes <tool_call> blocks; "
            f"{model}'s template writes {plan.fmt.name} calls (use /v1/chat/completions)")
    with request_field("text.format" if schema is not None else "tools"):
        params.structured_outputs = output_constraint(schema, None, plan)
        await compile_output(server, params.structured_outputs, plan, tenant)
    return plan


async def _events(service: SessionService, turn, builder: ResponseBuilder,
                  timeout_s: float | None):
    """SSE events of one streamed turn. A client that leaves, or ``timeout_s`` passing, ends
    it unstored (the stream's close aborts the request and releases the conversation)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    yield builder.opening()
    while True:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            out = await asyncio.wait_for(turn.outputs.get(), remaining)
        except TimeoutError:
            yield builder.failed("request_timeout", timeout_error(timeout_s)["error"]["message"])
            return
        if out.finish_reason == "error":
            error = engine_error(out)[1]["error"]
            yield builder.failed(error["code"], error["message"])
            return
        delta = builder.delta(out.new_text) if out.new_text else ""
        if out.finished:
            final = builder.response(out)
            try:
                service.finish(turn, out, final)
            except StateStoreUnavailableError as exc:  # the conversation is released
                yield delta + builder.failed(exc.code, str(exc))
                return
            yield delta + builder.closing(out, final)
            return
        if delta:
            yield delta


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict:
    """A stored response of the caller (404 for unknown, deleted or another key's)."""
    return request.app.state.sessions.get(caller(request).tenant, response_id).body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict:
    """Delete a stored response; its continuations keep their own state."""
    request.app.state.sessions.delete(caller(request).tenant, response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/v1/sessions")
async def list_sessions(request: Request) -> dict:
    """The caller's conversations, latest first (kvledger extension)."""
    rows = request.app.state.sessions.store.sessions(caller(request).tenant)
    return {"object": "list", "data": [
        {"id": r.session_id, "last_response_id": r.last_response_id, "turns": r.turns,
         "updated_at": r.updated_at} for r in rows]}
