"""HTTP routes: /health, /metrics, /v1/models, /tokenize, /v1/completions, /v1/chat/completions.

Generation handlers validate the body (pydantic, -> 400), refuse unsupported fields (-> 400
naming the field) and log unknown ones, check the model (-> 404), the stop-string limits (->
400) and the stream slots (-> 429), build the SamplingParams (-> 400), and add one engine
request per prompt through the engine thread, which raises context and quota errors (-> 400,
429 for a full queue) before any byte of a stream is sent; adding is all-or-nothing (a failed
add aborts the ones before it). Then they either stream SSE or wait for the final outputs,
aborting the requests if the client leaves or ``request_timeout_s`` passes.

What grows with a request runs in the tokenizer thread, off the event loop: a chat request's
tool plan and template messages, and the whole non-streamed body (built and serialised; the
heap given back after a large one, :mod:`..heap_trim`). Prompt logprobs past
``max_prompt_logprob_entries`` are refused once the prompts are tokenized (400). The grammar
tokenizer is set up before the server takes requests (:func:`warm_grammars`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from contextlib import contextmanager

from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import JSONResponse, Response

from kvledger.engine.sample.structured.constraint import StructuredOutputsParams
from kvledger.errors import InvalidParameterError, KVLedgerError
from kvledger.server.auth.tenancy import Caller, caller
from kvledger.server.heap_trim import trim_after
from kvledger.server.limits.input_size import bind_input_limits, check_prompt_logprobs
from kvledger.server.openai.error_handlers import error_response
from kvledger.server.openai.errors import ErrorResponse, UnsupportedParameterError
from kvledger.server.openai.formatters import ChatFormatter, CompletionFormatter, merge_choices
from kvledger.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from kvledger.server.openai.streaming import (
    ClientGone,
    EngineFailure,
    EngineStream,
    RequestTimedOut,
    collect,
    engine_error,
    sse_events,
    timeout_error,
)
from kvledger.server.tools.formats import ANY_OBJECT
from kvledger.server.tools.plan import output_constraint, plan_tools, template_messages

log = logging.getLogger("kvledger.server")

# One documented 4xx shape; it also keeps FastAPI from documenting its default 422.
ERRORS = {"4XX": {"model": ErrorResponse, "description": "OpenAI-shaped error (400, 401, 403, "
                  "404, 408, 409, 413, 429 with Retry-After)"},
          "503": {"model": ErrorResponse, "description": "engine stopped or server draining "
                  "(Retry-After)"},
          "504": {"model": ErrorResponse, "description": "request timeout "
                  "(--request-timeout-s)"}}
router = APIRouter(responses=ERRORS, dependencies=[Depends(bind_input_limits)])
STARTED = int(time.time())
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it
WARM_CONSTRAINT = StructuredOutputsParams(regex="[0-9]")  # compiled at start (warm_grammars)


def _state(request: Request):
    return request.app.state.server


def _model_card(state) -> dict:
    return {"id": state.model_name, "object": "model", "created": STARTED,
            "owned_by": "kvledger", "max_model_len": state.max_model_len}


@router.get("/health")
@router.head("/health", include_in_schema=False)  # load balancers probe with HEAD
async def health(request: Request):
    """200 while the engine thread runs, its engine can compute and the server takes requests,
    else 503 with the reason."""
    state = _state(request)
    if state.drain.draining:
        return error_response(503, "the server is shutting down (draining)", "server_draining")
    if not state.loop.alive:
        return error_response(503, "the engine thread has stopped; the server cannot generate",
                              "engine_unavailable")
    if state.loop.failure is not None:
        return error_response(503, f"the engine cannot generate: {state.loop.failure}",
                              "engine_unavailable")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition (metric names under ``kvledger:``; the ones routers read also
    under ``vllm:``, every one with ``--metrics-compat vllm``)."""
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
    _warn_unknown(body, request)
    state.check_model(body.model)
    tokens = await state.loop.tokenize(body.engine_input(),
                                       add_special_tokens=body.add_special_tokens)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """OpenAI text completion (one choice per prompt), streamed or not; ``echo`` and
    ``prompt_logprobs`` as vLLM serves them."""
    formatter = functools.partial(CompletionFormatter, echo=body.echo,
                                  prompt_only=body.prompt_only)
    return await _generate(request, body, formatter, "cmpl", logprobs=body.logprobs is not None)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """OpenAI chat completion (the model's chat template), streamed or not; vLLM's
    ``prompt_logprobs`` at the response's top level."""
    return await _generate(request, body, ChatFormatter, "chatcmpl", logprobs=body.logprobs)


class TooManyStreamsError(KVLedgerError):
    """``--max-concurrent-streams`` streams are open; retry later (HTTP 429)."""

    http_status = 429
    code = "too_many_streams"


def _warn_unknown(body, request: Request) -> None:
    unknown = body.unknown_fields()
    if unknown:  # escaped: a name with a newline must not forge a log line
        names = ", ".join(name.encode("unicode_escape").decode("ascii") for name in unknown)
        log.warning("%s: ignoring unknown request fields: %s", request.url.path, names[:500])


def _check_request(state, body) -> None:
    """The server's own limits on one request (stop strings, tools, stream slots)."""
    limits, stop = state.limits, body.stop_strings()
    if len(stop) > limits.max_stop_strings:
        raise UnsupportedParameterError(
            "stop", f"'stop' has {len(stop)} strings; this server takes at most "
                    f"{limits.max_stop_strings} (--max-stop-strings)")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise UnsupportedParameterError(
            "stop", f"a 'stop' string is longer than {limits.max_stop_chars} characters "
                    "(--max-stop-chars)")
    if any(not s for s in stop):
        raise UnsupportedParameterError("stop", "'stop' strings must not be empty")
    tools = getattr(body, "tools", None) or ()
    if len(tools) > limits.max_tools:
        raise UnsupportedParameterError(
            "tools", f"'tools' has {len(tools)} tools; this server takes at most "
                     f"{limits.max_tools} (--max-tools)")
    cap = limits.max_concurrent_streams
    if body.stream and cap is not None and state.streams >= cap:
        raise TooManyStreamsError(f"{cap} streams are open (--max-concurrent-streams); "
                                  "retry later")


async def compile_constraint(state, constraint, tenant: str | None) -> None:
    """Compile ``constraint`` in the grammar compiler's thread (the engine thread then finds it
    cached; ``tenant`` owns the cache entry).

    Raises:
        InvalidParameterError: the engine has no grammar support, or the constraint does not
            compile (HTTP 400 naming the unsupported feature).
    """
    if state.grammars is None:
        raise InvalidParameterError("structured output is not available on this engine (it "
                                    "has no tokenizer)")
    await asyncio.wrap_future(state.grammars.submit(constraint, tenant))


async def warm_grammars(grammars) -> None:
    """Compile :data:`WARM_CONSTRAINT` with ``grammars`` (a GrammarCompiler): the grammar
    tokenizer's set-up holds the GIL for up to a second, so it is done before the server takes
    requests rather than beside the first structured one."""
    try:
        await asyncio.wrap_future(grammars.submit(WARM_CONSTRAINT))
    except (InvalidParameterError, ValueError) as exc:  # the first structured request will
        # say it too (ValueError: llguidance refuses a tokenizer that lacks the model's EOS ids,
        # as a dummy-weight model's with the bundled tokenizer)
        log.warning("structured output could not be set up: %s", exc)


@contextmanager
def request_field(param: str):
    """Name ``param`` (the request field a constraint came from) on an InvalidParameterError
    raised inside that names none."""
    try:
        yield
    except InvalidParameterError as exc:
        if getattr(exc, "param", None) is None:
            exc.param = param
        raise


async def compile_output(state, constraint, plan, tenant: str | None) -> None:
    """Compile a request's constraint; each tool's parameters first, so that a schema the
    grammar cannot enforce is named by its tool.

    Raises:
        UnsupportedParameterError: a tool's parameters, or all tools' parameters together over
            a size limit (param ``tools``).
        InvalidParameterError: the constraint.
    """
    functions = plan.functions if plan is not None else ()
    if functions and state.grammars is not None:  # the reply's grammar holds them all
        together = StructuredOutputsParams(json={"anyOf": [
            f.parameters or ANY_OBJECT for f in functions]})
        try:
            state.grammars.limits.check(together)
        except InvalidParameterError as exc:
            raise UnsupportedParameterError(
                "tools", f"the tools' parameters together: {exc}") from None
    for function in functions:
        try:
            await compile_constraint(state, StructuredOutputsParams(
                json=function.parameters or ANY_OBJECT), tenant)
        except InvalidParameterError as exc:
            raise UnsupportedParameterError(
                "tools", f"tool {function.name!r}: {exc}") from None
    if constraint is not None:
        await compile_constraint(state, constraint, tenant)


async def _output_plan(state, body, model: str, params, tenant: str | None
                       ) -> tuple[list, object]:
    """The prompts and the tool plan of a request; ``params.structured_outputs`` is set to its
    constraint, compiled before the request is added."""
    response_format = getattr(body, "response_format", None)
    schema = response_format.schema() if response_format is not None else None
    prompts, plan, tools = body.prompts(), None, None
    if isinstance(body, ChatCompletionRequest):  # thousands of tools take a while
        plan, messages, tools = await state.loop.tokenizer_thread.run(
            _chat_plan, body, schema, state.tokenizer, model)
        prompts = [messages]
    with request_field("structured_outputs" if body.structured_outputs is not None else
                       "response_format" if schema is not None else "tools"):
        params.structured_outputs = output_constraint(schema, body.structured_outputs, plan)
        await compile_output(state, params.structured_outputs, plan, tenant)
    token_ids = [await state.loop.tokenize(prompt, tools) for prompt in prompts]
    check_prompt_logprobs(state.limits, token_ids, params.prompt_logprobs)
    return token_ids, plan


def _chat_plan(body: ChatCompletionRequest, schema, tokenizer, model: str):
    """A chat request's tool plan, template messages and tools (in the tokenizer thread)."""
    functions = [t.function for t in body.tools or []]
    plan = plan_tools(functions, body.tool_choice, body.parallel_tool_calls, schema,
                      tokenizer, model)
    return plan, *template_messages(body.messages, plan, tokenizer, model)


async def _add_all(state, request_ids: list[str], prompts: list, params,
                   who: Caller, cache_salt: str | None) -> asyncio.Queue:
    """Add one engine request per prompt, sharing one output queue; all or nothing."""
    outputs: asyncio.Queue = asyncio.Queue()
    added: list[str] = []
    try:
        for request_id, prompt in zip(request_ids, prompts, strict=True):
            await state.loop.add(request_id, prompt, params, outputs, cache_salt=cache_salt,
                                 tenant=who.tenant)
            added.append(request_id)
    except BaseException:
        for request_id in added:
            state.loop.abort(request_id)
        raise
    return outputs


async def _generate(request: Request, body, formatter_cls, id_prefix: str, logprobs: bool):
    state = _state(request)
    body.check_supported()
    _warn_unknown(body, request)
    model = state.check_model(body.model)
    _check_request(state, body)
    params = body.sampling_params()
    response_id = f"{id_prefix}-{uuid.uuid4().hex}"
    streaming = body.stream  # count the slot before the first await, so the cap holds
    if streaming:
        state.streams += 1
    try:
        who = caller(request)
        prompts, tool_plan = await _output_plan(state, body, model, params, who.tenant)
        request_ids = ([response_id] if len(prompts) == 1
                       else [f"{response_id}-{i}" for i in range(len(prompts))])
        outputs = await _add_all(state, request_ids, prompts, params, who,
                                 who.cache_salt(body.cache_salt))
    except BaseException:
        if streaming:
            state.streams -= 1
        raise
    formatters = {rid: formatter_cls(response_id, model, state.tokenizer, logprobs, index=i,
                                     continuous_usage=body.continuous_usage,
                                     tool_parser=tool_plan.parser() if tool_plan is not None
                                     else None,
                                     prompt_logprobs=body.prompt_logprobs is not None)
                  for i, rid in enumerate(request_ids)}

    def abort() -> None:
        for rid in request_ids:
            state.loop.abort(rid)

    timeout_s = state.limits.request_timeout_s
    if streaming:
        def close() -> None:
            abort()
            state.streams -= 1

        events = sse_events(outputs, formatters, body.include_usage, abort, timeout_s)
        return EngineStream(events, close, state.limits.send_timeout_s)
    try:
        finals = await collect(outputs, request, abort, len(request_ids), timeout_s)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except RequestTimedOut:  # the same request would time out again: no Retry-After
        return JSONResponse(timeout_error(timeout_s), status_code=504)
    except EngineFailure as exc:
        status, error = engine_error(exc.args[0])
        return JSONResponse(error, status_code=status)
    def respond() -> JSONResponse:  # prompt logprobs make bodies of megabytes
        bodies = [formatters[rid].response(*finals[rid]) for rid in request_ids]
        finals.clear()  # the outputs (prompt logprobs: many small objects) go before the trim
        response = JSONResponse(bodies[0] if len(bodies) == 1 else merge_choices(bodies))
        del bodies
        trim_after(len(response.body))
        return response

    return await state.loop.tokenizer_thread.run(respond)
