"""The engine thread: the one thread that owns the (not thread-safe) LLMEngine.

The asyncio event loop serves HTTP; this thread runs continuous batching beside it, so every
concurrent request joins the same engine steps. The two sides talk through:

- an inbox (``queue.SimpleQueue``) of commands: a call of a function on the engine (adding a
  request) answered through a ``concurrent.futures.Future``, or an abort;
- one entry per live request (``_Stream``: its event loop, its ``asyncio.Queue`` and the
  observer's track; the server's only per-request table), the queue fed with a snapshot of that request's ``RequestOutput``
  after each step via ``loop.call_soon_threadsafe`` (one hand-off per step for all requests);
  snapshots, because the engine mutates its outputs in place on the next step.

Prompts are tokenized before they are added, in the tokenizer thread
(:mod:`.tokenizer_thread`; ``engine.tokenize`` reads only the tokenizer and fixed facts), so a
long prompt stalls neither the event loop nor the other requests' steps.

Loop invariant: drain the inbox, then ``step()`` while the engine has unfinished requests, else
sleep on an event that every new command sets. Commands are handled in arrival order, so an
abort sent after an add always finds its request. An add is validated in this thread (context
length, KV quota, queue size) and its error reaches the HTTP handler before any stream starts.
If an iteration fails (a bug in ``step()``), every live request gets an ``error`` output and is
aborted; the thread keeps serving. An engine that can no longer compute (a tensor-parallel rank
died or hung: ``engine.failure``) fails its live requests with :data:`UNAVAILABLE_ERROR` (HTTP
503), and refuses new ones with the same status. On shutdown the live requests get an ``error`` output too,
and once the thread has exited (or while it stops) every call fails at once with
:class:`EngineUnavailableError` (503) instead of waiting for an answer that never comes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvledger.engine.output.request_output import RequestOutput
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import KVBudgetError, KVLedgerError
from kvledger.server.heap_trim import PeriodicTrim
from kvledger.server.metrics.observer import RequestObserver, RequestTrack
from kvledger.server.tokenizer_thread import TokenizerThread

log = logging.getLogger("kvledger.server")

IDLE_WAKE_S = 1.0  # idle loop period: the periodic engine log still runs
INTERNAL_ERROR = "internal engine error"  # prefix of the error of requests failed by a bug
SHUTDOWN_ERROR = "the server is shutting down"  # error of requests cut off by a stop
UNAVAILABLE_ERROR = "engine unavailable"  # prefix of the error of requests an engine failure cut


class QueueFullError(KVLedgerError):
    """The server's waiting queue holds ``--max-queue`` requests; retry later (HTTP 429)."""

    http_status = 429
    code = "queue_full"


@dataclass(slots=True)
class _Stream:
    """Where one live request's outputs go, and its observer track."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    track: RequestTrack
    tenant: str = ""


class EngineUnavailableError(KVLedgerError):
    """The engine thread has stopped or is stopping (HTTP 503)."""

    http_status = 503
    code = "engine_unavailable"


class EngineLoop:
    """Runs ``engine.step()`` in a dedicated thread and routes outputs to asyncio queues.

    Args:
        engine: an ``LLMEngine`` (or any object with its API); only this thread touches it.
        observer: receives every output and the engine stats after each step.
        max_queue: most requests waiting for a slot; more are refused (None = no limit).
    """

    def __init__(self, engine: Any, observer: RequestObserver, max_queue: int | None = None):
        self._engine = engine
        self._observer = observer
        self._max_queue = max_queue
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._heap = PeriodicTrim()
        self._stopping = False
        self._closed = False  # set under _lock when the thread stops taking commands
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvledger-engine", daemon=True)
        self.tokenizer_thread = TokenizerThread()

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and takes commands."""
        return self._thread.is_alive() and not self._closed and not self._stopping

    @property
    def failure(self) -> str | None:
        """Why the engine cannot compute any more (``engine.failure``), else None."""
        return getattr(self._engine, "failure", None)

    def start(self) -> None:
        """Start the engine thread, after freeing the calling thread's workers (the engine
        thread computes from now on: ``engine.device.release_thread_pool``)."""
        self._engine.device.release_thread_pool()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the engine thread to exit and wait for it."""
        self._stopping = True
        self._wake.set()
        self.tokenizer_thread.close()
        self._thread.join(timeout_s)

    def owners(self) -> dict[str, str]:
        """The tenant of every live request, by id (call in the engine thread)."""
        return {request_id: stream.tenant for request_id, stream in self._streams.items()}

    def _refuse_if_closed(self) -> None:
        if self._closed or self._stopping or not self._thread.is_alive():
            raise EngineUnavailableError("the engine is not running (the server is stopping "
                                         "or its engine thread has exited); retry later")

    async def tokenize(self, prompt: Any, tools: list[dict] | None = None,
                       add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt (``engine.tokenize``, with the chat template's ``tools``),
        computed in the tokenizer thread.

        Raises:
            InvalidParameterError, ContextLengthError: as ``engine.tokenize`` (HTTP 400).
            EngineUnavailableError: the engine thread has stopped (HTTP 503).
        """
        self._refuse_if_closed()
        return await self.tokenizer_thread.run(self._engine.tokenize, prompt, add_special_tokens,
                                               tools)  # engine.tokenize's order

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread; return its result or raise its error."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._refuse_if_closed()
            self._inbox.put(("call", fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def add(self, request_id: str, prompt: Any, params: SamplingParams,
                  outputs: asyncio.Queue | None = None,
                  cache_salt: str | None = None, tenant: str = "") -> asyncio.Queue:
        """Add a request; return the queue its ``RequestOutput``\\ s arrive on (``outputs``
        if given: several requests may share one queue). ``cache_salt`` keeps its
        prefix-cache blocks apart from other salts' (:mod:`.auth.tenancy`); ``tenant`` owns it
        (the dashboard shows a tenant its own requests).

        Raises:
            ContextLengthError, InvalidParameterError (400), KVBudgetError, QueueFullError (429).
        """
        loop = asyncio.get_running_loop()
        outputs = asyncio.Queue() if outputs is None else outputs

        def add(engine: Any) -> None:
            if self._max_queue is not None and engine.stats()["num_waiting"] >= self._max_queue:
                raise QueueFullError(
                    f"the server's queue is full ({self._max_queue} requests waiting); retry later"
                )
            try:
                engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
            except KVBudgetError:
                self._observer.on_quota_rejected()
                raise
            self._streams[request_id] = _Stream(loop, outputs, self._observer.on_added(request_id),
                                                tenant)

        try:
            await self.call(add)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return outputs

    def abort(self, request_id: str) -> None:
        """Abort a request (its KV blocks are freed before the next step). Never raises."""
        self._inbox.put(("abort", request_id, None))
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._iterate()
                except Exception as exc:
                    if isinstance(exc, KVLedgerError) and exc.http_status == 503:
                        log.error("engine step failed: %s; failing %d live requests", exc,
                                  len(self._streams))  # the engine cannot compute
                        self._fail_all(f"{UNAVAILABLE_ERROR}: {exc}")
                        continue
                    # a bug: fail the live requests, keep serving
                    log.exception("engine step failed; failing %d live requests",
                                  len(self._streams))
                    self._fail_all(f"{INTERNAL_ERROR}: {exc}")
        finally:
            self._close()

    def _close(self) -> None:
        """Refuse new commands, fail the queued calls and the live requests."""
        with self._lock:
            self._closed = True
        gone = EngineUnavailableError("the engine stopped before serving this request")
        while True:
            try:
                kind, _arg, future = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "call" and future.set_running_or_notify_cancel():
                future.set_exception(gone)
        self._fail_all(SHUTDOWN_ERROR if self._stopping
                       else f"{INTERNAL_ERROR}: the engine thread exited")

    def _iterate(self) -> None:
        worked = self._drain_inbox()
        outputs = self._engine.step() if self._engine.has_unfinished_requests() else None
        # the gauges before the outputs: a client that has its answer sees them after its step
        self._observer.on_stats(self._engine.stats(), time.perf_counter())
        if outputs is not None:
            self._deliver(outputs)
            self._heap.maybe_trim()  # freed heap back to the OS every 30 s (heap_trim.py)
            worked = True
        if not worked:
            self._wake.wait(IDLE_WAKE_S)
            self._wake.clear()

    def _drain_inbox(self) -> bool:
        worked = False
        while True:
            try:
                kind, arg, future = self._inbox.get_nowait()
            except queue.Empty:
                return worked
            worked = True
            if kind == "abort":
                self._abort_now(arg)
            elif future.set_running_or_notify_cancel():
                try:
                    future.set_result(arg(self._engine))
                except Exception as exc:  # noqa: BLE001 - handed to the caller, who maps it to HTTP
                    future.set_exception(exc)

    def _abort_now(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished already, or never added
        try:
            self._engine.abort(request_id)
        except Exception:
            log.exception("engine.abort(%s) failed", request_id)
        self._observer.on_aborted(stream.track)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by the server; its outputs have no reader
            self._observer.on_output(stream.track, out, now)
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.loop, []).append((stream.outputs, snapshot(out)))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                log.warning("event loop closed; dropping %d outputs", len(items))

    def _fail_all(self, message: str) -> None:
        failed = []
        for request_id in list(self._streams):
            failed.append(RequestOutput(request_id=request_id, prompt_token_ids=[],
                                        finished=True, finish_reason="error", error=message))
            try:
                self._engine.abort(request_id)
            except Exception:
                log.exception("engine.abort(%s) failed", request_id)
        self._deliver(failed)


def snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the engine will not mutate: it updates one RequestOutput per request in place."""
    copy = dataclasses.replace(out, metrics=dataclasses.replace(out.metrics))
    if out.logprobs is not None:
        copy.logprobs = list(out.logprobs)
    return copy


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for outputs, out in items:
        outputs.put_nowait(out)
