"""One conversation turn, end to end: previous state -> prompt ids -> engine -> stored reply.

:meth:`SessionService.start` does everything that can refuse the turn before a byte is sent
(unknown previous response 404, busy conversation 409, bad document 400/413, over budget 400,
engine refusals 400/429): it takes the conversation's lock (turns of one conversation are
serialised; a turn waits up to ``session_wait_s`` for the previous one, then gets 409),
stitches retrieved passages into the user text, plans the prompt with the memory policy
(which may ask the served model for a summary or a segment note first) and adds the request.
:meth:`SessionService.finish` stores the reply with the conversation's exact ids and releases
the lock; :meth:`SessionService.cancel` only releases it (nothing stored).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvledger.engine.output.request_output import RequestOutput
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import InvalidParameterError, KVBudgetError
from kvledger.sessions.codec import TurnCodec
from kvledger.sessions.errors import ResponseNotFoundError, SessionBusyError, TurnTooLargeError
from kvledger.sessions.expiry import SWEEP_INTERVAL_S, check_quota, expire
from kvledger.sessions.memory import (
    ConversationState,
    MemoryOptions,
    MemoryPlanner,
    TurnPlan,
)
from kvledger.sessions.retrieval import MAX_DOCUMENT_BYTES, Retriever, chunk_text
from kvledger.sessions.store import Chunk, SessionStore, StoredResponse

DEFAULT_MAX_OUTPUT_TOKENS = 512  # reserved for the reply when max_output_tokens is omitted
FIT_ATTEMPTS = 4
FIT_MARGIN = 0.9  # cut a little more than the proportion, as tokens per character vary
PASSAGES_HEADER = "Passages from the attached documents and earlier notes:"


@dataclass(frozen=True)
class SessionOptions:
    """Server-wide session settings (``kvledger serve --state-db --memory ...``)."""

    state_db: str = ":memory:"
    memory: str = "summary"
    segment_turns: int = 8
    segment_tokens: int | None = None
    retrieve_k: int = 2
    max_document_bytes: int = MAX_DOCUMENT_BYTES
    session_wait_s: float = 30.0
    max_age_s: float | None = None  # expiry (sessions/expiry.py); None: kept
    max_bytes: int | None = None
    quota_bytes: int | None = None  # per API key


@dataclass
class TurnInput:
    """A parsed request: the user's text, its documents ``(filename, text)`` and settings."""

    text: str
    documents: list[tuple[str, str]]
    instructions: str | None
    previous_response_id: str | None
    params: SamplingParams
    max_output_tokens: int | None
    truncation: str
    memory: str | None
    store: bool
    tools: str | None = None  # tool declarations for the system message (None: keep the old)
    messages: list[dict] | None = None  # the turn's chat messages when not one user text


@dataclass
class Turn:
    """A started turn: what :meth:`SessionService.finish` needs."""

    response_id: str
    session_id: str
    tenant: str
    plan: TurnPlan
    outputs: asyncio.Queue
    request: TurnInput
    budget: int
    retrieved: list[dict] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    stored: bool = False  # its response row is written (its chunks are kept)
    _release: Callable[[], None] | None = None


async def final_output(outputs: asyncio.Queue) -> RequestOutput:
    """Wait for a request's last output."""
    while True:
        out = await outputs.get()
        if out.finished:
            return out


def _make_codec(engine) -> TurnCodec:
    """The engine's TurnCodec (engine thread).

    Raises:
        InvalidParameterError: the model has no usable chat template (HTTP 400).
    """
    try:
        return TurnCodec(engine.tokenizer, set(engine.spec.eos_token_ids))
    except InvalidParameterError:
        raise
    except Exception as exc:  # noqa: BLE001 - no template, no tokenizer, a jinja error
        raise InvalidParameterError(
            f"the served model has no usable chat template, which /v1/responses needs: "
            f"{type(exc).__name__}: {exc}") from None


def _with_passages(messages: list[dict] | None, passages: str) -> list[dict] | None:
    """The turn's messages with the retrieved ``passages`` before its last user message's
    content (unchanged without passages or a user message)."""
    users = [i for i, m in enumerate(messages or []) if m["role"] == "user"]
    if not passages or not users:
        return messages
    last = messages[users[-1]]
    return [*messages[:users[-1]], {**last, "content": passages + last["content"]},
            *messages[users[-1] + 1:]]


class SessionService:
    """Turns of stored conversations on one engine loop.

    Args:
        loop: the server's :class:`EngineLoop` (every tokenizer and engine call goes through it).
        store: the state store.
        limit_tokens: most tokens (prompt + reply) one request may reach (ledger admission).
        block_size: KV block size in tokens (prefix padding).
        options: :class:`SessionOptions`.
        metrics: a :class:`SessionMetrics` or None.
    """

    def __init__(self, loop, store: SessionStore, limit_tokens: int, block_size: int,
                 options: SessionOptions, metrics=None) -> None:
        self.loop, self.store, self.options, self.metrics = loop, store, options, metrics
        self.limit_tokens = limit_tokens
        self.block_size = block_size
        self.retriever = Retriever()
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._planner: MemoryPlanner | None = None

    async def planner(self) -> MemoryPlanner:
        """The memory planner (its codec probes the chat template once, in the engine thread);
        it tokenizes in the tokenizer thread, as the turn's stitching does."""
        if self._planner is None:
            codec = await self.loop.call(_make_codec)
            self._planner = MemoryPlanner(codec, MemoryOptions(
                block_size=self.block_size, segment_turns=self.options.segment_turns,
                segment_tokens=self.options.segment_tokens), run=self.loop.tokenizer_thread.run)
        return self._planner

    async def _lock(self, tenant: str, session_id: str) -> Callable[[], None]:
        lock = self._locks.setdefault((tenant, session_id), asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), self.options.session_wait_s)
        except TimeoutError:
            raise SessionBusyError(
                f"another turn of conversation {session_id} has run for over "
                f"{self.options.session_wait_s:g} s; retry when it has finished") from None
        return lock.release

    def get(self, tenant: str, response_id: str) -> StoredResponse:
        """A stored response of this tenant. Raises ResponseNotFoundError (404)."""
        rec = self.store.get_response(tenant, response_id)
        if rec is None:
            raise ResponseNotFoundError(f"no response with id {response_id!r} (unknown, deleted"
                                        " or created with another API key)")
        return rec

    async def start(self, tenant: str, salt: str | None, req: TurnInput) -> Turn:
        """Plan and add one turn; the conversation stays locked until finish() or cancel().

        Raises:
            ResponseNotFoundError (404), SessionBusyError (409), TurnTooLargeError and
            InvalidParameterError (400), ContextLengthError (400), KVBudgetError (429),
            StateQuotaError (403).
        """
        response_id = f"resp_{uuid.uuid4().hex}"
        if req.store:
            check_quota(self.store, tenant, self.options.quota_bytes)
        prev = self.get(tenant, req.previous_response_id) if req.previous_response_id else None
        session_id = prev.session_id if prev else response_id
        release = await self._lock(tenant, session_id)
        try:
            return await self._start(tenant, salt, req, response_id, session_id, prev, release)
        except BaseException:
            try:
                self._forget_documents(tenant, response_id, req)
            finally:
                release()
            raise

    def _forget_documents(self, tenant: str, response_id: str, req: TurnInput) -> None:
        """Delete the documents a turn that will not be stored attached."""
        if req.store and req.documents:
            self.store.delete_chunks_of(tenant, response_id)

    async def _start(self, tenant, salt, req: TurnInput, response_id: str, session_id: str,
                     prev: StoredResponse | None, release) -> Turn:
        planner, run = await self.planner(), self.loop.tokenizer_thread.run
        policy = req.memory or self.options.memory
        if prev is None:
            ids, state = await run(planner.first_state, req.instructions, policy, req.tools)
        else:
            ids, state = await run(planner.with_system, prev.token_ids,
                                   ConversationState.from_json(prev.state), req.instructions,
                                   req.tools)
            state.policy = policy
        max_out = req.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS
        budget = self.limit_tokens - max_out
        if budget < 1:
            raise InvalidParameterError(
                f"max_output_tokens {max_out} leaves no room for a prompt within the "
                f"{self.limit_tokens}-token limit (context or per-request KV quota)")
        text, retrieved = await run(self._stitch, tenant, session_id, response_id, req, state)

        async def condense(kind: str, messages: list[dict], max_tokens: int) -> str:
            if self.metrics:
                self.metrics.count_event(kind)
            return await self._generate_note(messages, max_tokens, salt, tenant)

        messages = _with_passages(req.messages, text[:len(text) - len(req.text)])
        plan = await planner.plan(ids, state, text, budget, req.truncation, condense, messages)
        plan.state.turns[-1].chunk_ids = [r["chunk_id"] for r in retrieved]
        params = req.params
        params.max_tokens = max_out
        outputs = await self.loop.add(response_id, plan.prompt_ids, params, cache_salt=salt,
                                      tenant=tenant)
        return Turn(response_id, session_id, tenant, plan, outputs, req, budget, retrieved,
                    _release=release)

    def _stitch(self, tenant: str, session_id: str, response_id: str, req: TurnInput,
                state: ConversationState) -> tuple[str, list[dict]]:
        """The user text with the top-k passages for it prepended; the passages' descriptions.
        Stored documents are owned by ``response_id`` (deleted with it, or if it is never
        stored)."""
        pieces = [(name, piece) for name, text in req.documents for piece in chunk_text(text)]
        transient = [Chunk(-1 - i, "document", name, piece)
                     for i, (name, piece) in enumerate(pieces)]
        if req.store and transient:
            for name, text in req.documents:
                self.store.add_chunks(tenant, session_id, "document", name, chunk_text(text),
                                      owner=response_id)
            transient = []
        chunks = self.store.chunks(tenant, session_id) + transient
        in_prompt = {cid for t in state.turns for cid in t.chunk_ids}
        in_prompt |= {c.id for c in chunks if c.kind == "note" and c.text in state.notes}
        known = [state.system or "", state.summary, *state.notes,
                 *(text for t in state.turns for text in (t.user, t.reply))]
        top = self.retriever.top_k(chunks, req.text, self.options.retrieve_k, in_prompt, known)
        if not top:
            return req.text, []
        if self.metrics:
            self.metrics.count_event("retrieval", len(top))
        passages = "\n".join(f"[{c.source}] {c.text}" for c, _ in top)
        retrieved = [{"chunk_id": c.id, "source": c.source, "score": round(s, 4)} for c, s in top]
        return f"{PASSAGES_HEADER}\n{passages}\n\n{req.text}", retrieved

    async def _generate_note(self, messages: list[dict], max_tokens: int,
                             salt: str | None, tenant: str) -> str:
        request_id = f"memory-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        ids = await self._fit(messages, self.limit_tokens - max_tokens)
        outputs = await self.loop.add(request_id, ids, params, cache_salt=salt, tenant=tenant)
        try:
            out = await final_output(outputs)
        except asyncio.CancelledError:
            self.loop.abort(request_id)
            raise
        if out.finish_reason == "error":
            raise KVBudgetError(f"the model could not write the conversation's memory: "
                                f"{out.error}")
        return out.text

    async def _fit(self, messages: list[dict], room: int) -> list[int]:
        """Token ids of ``messages`` (chat template) within ``room`` tokens: the last
        message's text loses its oldest part (a transcript keeps its latest turns)."""
        for _ in range(FIT_ATTEMPTS):
            ids = await self.loop.tokenize(messages)
            if len(ids) <= room:
                return ids
            content = messages[-1]["content"]
            keep = int(len(content) * room / len(ids) * FIT_MARGIN)
            messages = messages[:-1] + [{**messages[-1], "content": content[-keep:]}]
        raise TurnTooLargeError(f"the memory prompt needs {len(ids)} tokens; only {room} fit")

    def finish(self, turn: Turn, out: RequestOutput, body: dict) -> None:
        """Store the finished turn (unless ``store`` is false) and release the conversation."""
        try:
            state = turn.plan.state
            state.turns[-1].reply = out.text
            if turn.request.store:
                ids = turn.plan.prompt_ids + list(out.token_ids)
                self.store.put_response(StoredResponse(
                    turn.response_id, turn.tenant, turn.session_id,
                    turn.request.previous_response_id, body, state.to_json(), ids,
                    len(turn.plan.prompt_ids), turn.created_at))
                turn.stored = True
                if turn.plan.note:
                    self.store.add_chunks(turn.tenant, turn.session_id, "note",
                                          f"note {state.segment}", [turn.plan.note],
                                          owner=turn.response_id)
                if self.options.max_bytes is not None:
                    self.expire()
            if self.metrics:
                self.metrics.count_turn(out)
        finally:
            self.cancel(turn)

    def close(self) -> None:
        """Close the state store (at server shutdown, after the drain)."""
        self.store.close()

    def expire(self) -> None:
        """Delete the conversations past ``max_age_s`` or ``max_bytes`` (and count them)."""
        removed = expire(self.store, self.options.max_age_s, self.options.max_bytes,
                         time.time())
        if self.metrics:
            self.metrics.count_removed(removed)

    async def sweep_forever(self) -> None:
        """Expire every SWEEP_INTERVAL_S seconds in a worker thread (cancel to stop)."""
        if self.options.max_age_s is None and self.options.max_bytes is None:
            return
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            await asyncio.to_thread(self.expire)

    def cancel(self, turn: Turn) -> None:
        """Release the conversation; a turn not stored loses the documents it attached."""
        if turn._release is None:
            return
        try:
            if not turn.stored:
                self._forget_documents(turn.tenant, turn.response_id, turn.request)
        finally:
            turn._release()
            turn._release = None

    def delete(self, tenant: str, response_id: str) -> None:
        """Delete one stored response. Raises ResponseNotFoundError (404)."""
        if not self.store.delete_response(tenant, response_id):
            raise ResponseNotFoundError(f"no response with id {response_id!r} (unknown, deleted"
                                        " or created with another API key)")

    def describe(self, turn: Turn) -> dict[str, Any]:
        """kvledger's extension fields of a response: memory policy, events, budget."""
        state = turn.plan.state
        return {"memory": state.policy, "memory_event": turn.plan.event,
                "budget_tokens": turn.budget, "prefix_tokens": state.prefix_len,
                "summary_rewrites": state.rewrites, "segment": state.segment,
                "turns_in_prompt": len(state.turns), "turn": state.total_turns,
                "retrieved": turn.retrieved, "session_id": turn.session_id}
