"""A fake engine with LLMEngine's API, for fast server tests without a model.

Tokens are characters (token id = code point). A request emits the characters of ``TEXT`` (or
the engine's ``text``) one per step, then ``"stop"`` at its end (unless ``ignore_eos``), or ``"length"`` at ``max_tokens``.
Each token holds ``KV_BYTES_PER_TOKEN`` bytes of KV. Context and quota checks mirror the real
engine's contract: prompt + max_tokens over ``max_model_len`` -> ContextLengthError, over the
quota -> KVBudgetError. A prefix cache of blocks of ``BLOCK_SIZE`` tokens, as the engine's
(``engine/kv/prefix.py``): a request's ``num_cached_tokens`` are the whole blocks of its prompt
(never its last token) that an earlier request with the same ``cache_salt`` had.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import ClassVar

from kvledger.device import resolve
from kvledger.engine.output.request_output import RequestMetrics, RequestOutput, TokenLogprob
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import ContextLengthError, InvalidParameterError, KVBudgetError

TEXT = "Hello from the fake engine."
KV_BYTES_PER_TOKEN = 100
BLOCK_SIZE = 16
VOCAB_SIZE = 0x110000  # every code point: the fake tokenizer's ids


class FakeTokenizer:
    """decode(ids) joins code points."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class _Req:
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    out: list[int] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)


class FakeEngine:
    """Same API as LLMEngine; not thread-safe on purpose (asserts a single owner thread),
    except ``tokenize``, which the server calls from its tokenizer thread."""

    model_name = "fake-model"
    device = resolve("cpu")  # the engine loop hands the device's workers to its thread
    max_model_len = 256
    cache_config: ClassVar[dict] = {"block_size": "16", "cache_dtype": "fp32"}

    def __init__(self, step_delay_s: float = 0.0, kv_quota_tokens: int | None = None,
                 text: str = TEXT):
        self.tokenizer = FakeTokenizer()
        self.text = text
        self.step_delay_s = step_delay_s
        self.kv_quota_tokens = kv_quota_tokens
        self.fail_next_step = False  # step() raises (an engine bug)
        self.refuse_message: str | None = None  # step() fails every request, as the scheduler
        self.requests: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.owner: threading.Thread | None = None
        self.cached_blocks: set[int] = set()  # chained hashes of (salt, full prompt blocks)

    def _check_thread(self) -> None:
        self.owner = self.owner or threading.current_thread()
        assert self.owner is threading.current_thread(), "engine used from two threads"

    def tokenize(self, prompt, add_special_tokens: bool = True, tools=None) -> list[int]:
        assert tools is None, "the fake's template takes no tools"
        if prompt and isinstance(prompt, list) and isinstance(prompt[0], int):
            bad = [t for t in prompt if not 0 <= t < VOCAB_SIZE]  # as the engine refuses them
            if bad:
                raise InvalidParameterError(
                    f"token id {bad[0]} is outside the vocabulary [0, {VOCAB_SIZE})")
            return list(prompt)
        if isinstance(prompt, list):
            prompt = "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "
        return [ord(c) for c in prompt]

    def add_request(self, request_id, prompt, params: SamplingParams, cache_salt=None) -> None:
        self._check_thread()
        ids = prompt if prompt and isinstance(prompt[0], int) else self.tokenize(prompt)
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len or max_tokens <= 0:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(ids)} tokens and max_tokens is {params.max_tokens}"
            )
        if self.kv_quota_tokens and len(ids) + max_tokens > self.kv_quota_tokens:
            raise KVBudgetError(f"request needs {len(ids) + max_tokens} tokens of KV")
        req = _Req(ids, params, max_tokens)
        req.metrics.num_cached_tokens = self._cache(ids, cache_salt)
        req.metrics.arrival_time = time.perf_counter()
        req.metrics.num_prompt_tokens = len(ids)
        self.requests[request_id] = req

    def _cache(self, ids: list[int], salt: str | None) -> int:
        """Tokens of ``ids`` found in the prefix cache; its full blocks are cached after."""
        hashes, parent = [], hash(salt)
        for end in range(BLOCK_SIZE, len(ids) + 1, BLOCK_SIZE):
            parent = hash((parent, tuple(ids[end - BLOCK_SIZE:end])))
            hashes.append(parent)
        hit = 0
        while hit < (len(ids) - 1) // BLOCK_SIZE and hashes[hit] in self.cached_blocks:
            hit += 1
        self.cached_blocks.update(hashes)
        return hit * BLOCK_SIZE

    def abort(self, request_id: str) -> None:
        self._check_thread()
        self.aborted.append(request_id)
        self.requests.pop(request_id, None)

    def reset_prefix_cache(self) -> int:
        self._check_thread()
        dropped, self.cached_blocks = len(self.cached_blocks), set()
        return dropped  # every tenant's cached blocks (none is in use between requests here)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._check_thread()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        time.sleep(self.step_delay_s)
        if self.refuse_message:
            refused = [RequestOutput(rid, r.prompt_ids, finished=True, finish_reason="error",
                                     error=self.refuse_message) for rid, r in self.requests.items()]
            self.requests.clear()
            return refused
        return [self._advance(rid, req) for rid, req in list(self.requests.items())]

    def _advance(self, request_id: str, req: _Req) -> RequestOutput:
        now = time.perf_counter()
        token = ord(self.text[len(req.out) % len(self.text)])
        req.out.append(token)
        req.metrics.first_token_time = req.metrics.first_token_time or now
        req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
        req.metrics.last_token_time = now
        req.metrics.peak_kv_bytes = (len(req.prompt_ids) + len(req.out)) * KV_BYTES_PER_TOKEN
        reason = None
        if len(req.out) >= req.max_tokens:
            reason = "length"
        elif len(req.out) == len(self.text) and not req.params.ignore_eos:
            reason = "stop"
        if reason:
            del self.requests[request_id]
        lps = None
        if req.params.logprobs is not None:
            top = [(token, -0.25), (ord("?"), -2.0)][: req.params.logprobs]
            lps = [TokenLogprob(t, -0.25 - i, top) for i, t in enumerate(req.out)]
        return RequestOutput(
            request_id=request_id, prompt_token_ids=req.prompt_ids, token_ids=list(req.out),
            text="".join(map(chr, req.out)), new_token_ids=[token], new_text=chr(token),
            finished=reason is not None, finish_reason=reason, logprobs=lps,
            prompt_logprobs=self._prompt_logprobs(req), metrics=req.metrics,
        )

    @staticmethod
    def _prompt_logprobs(req: _Req) -> list | None:
        """Prompt token i: logprob -i / 10, rank i, top ``prompt_logprobs`` alternatives
        ``"?"`` at -0.05 then ``"!"`` at -0.07."""
        k = req.params.prompt_logprobs
        if k is None:
            return None
        top = [(ord("?"), -0.05), (ord("!"), -0.07)][:k]
        return [None] + [TokenLogprob(t, -i / 10, top, i)
                         for i, t in enumerate(req.prompt_ids[1:], start=1)]

    def stats(self) -> dict:
        used = sum(len(r.prompt_ids) + len(r.out) for r in self.requests.values())
        in_use = sum(-(-(len(r.prompt_ids) + len(r.out)) // 16) for r in self.requests.values())
        return {"kv_blocks_total": 256, "kv_blocks_free": 256 - in_use, "kv_blocks_evictable": 0,
                "num_running": len(self.requests), "num_waiting": 0,
                "kv_usage": used / 4096, "kv_bytes_allocated": used * KV_BYTES_PER_TOKEN,
                "kv_bytes_predicted": used * KV_BYTES_PER_TOKEN,
                "prefix_cache_queried_tokens": 10, "prefix_cache_hit_tokens": 5,
                "num_preemptions": 0}
