"""LLMEngine: requests in, tokens out, one scheduler step at a time.

Each ``step()``: the scheduler picks chunks (continuous batching, chunked prefill, preemption)
and allocates their KV slots; the runner runs one forward over all of them; the sampler picks a
token for every sequence that reached its end; the detokenizer turns tokens into text and stop
conditions finish requests, whose blocks go back to the pool (full blocks stay in the prefix
cache). The pool is sized with the ledger's bytes per block, so the pool tensors hold exactly
what ``kvledger plan`` predicts. The engine is single-threaded: callers serialize access.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvledger.engine.config import EngineConfig
from kvledger.engine.detokenizer import IncrementalDetokenizer
from kvledger.engine.kv.store import KV_FORMAT_OF_DTYPE, KVStore
from kvledger.engine.model import LlamaModel
from kvledger.engine.outputs import RequestOutput
from kvledger.engine.prompts import encode_prompt
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sampling import Sampler
from kvledger.engine.sampling_params import SamplingParams
from kvledger.engine.scheduler import Scheduler
from kvledger.engine.sequence import Sequence
from kvledger.errors import ContextLengthError, InvalidParameterError, KVBudgetError
from kvledger.ledger.kv import kv_bytes_per_block, kv_bytes_per_token
from kvledger.spec import ModelSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_POOL_CAP_BYTES = 1 << 30


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer
    output: RequestOutput


def _text_chars(prompt) -> int:
    """Characters of a text prompt or of all chat messages' contents (0 for token ids)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(m["content"]) for m in prompt
                   if isinstance(m, dict) and isinstance(m.get("content"), str))
    return 0


def _model_name(model: str) -> str:
    """The id clients use: the file stem of a GGUF, the folder name of an HF model."""
    from kvledger.paths import resolve_model_path

    path = resolve_model_path(model)
    return path.stem if path.is_file() else path.name


class LLMEngine:
    """The inference engine over one model.

    Args:
        config: engine options (model path, dtype, pool size, scheduler limits).
        spec, weights, tokenizer: an already loaded model (tests); by default they are loaded
            from ``config.model``. ``tokenizer`` may be None for token-id-only use.

    Raises:
        ModelNotFoundError, ConfigError, UnsupportedModelError: the model cannot be loaded.
        InvalidParameterError: bad dtype. KVBudgetError: the pool has no room for one block.
    """

    def __init__(self, config: EngineConfig, spec: ModelSpec | None = None,
                 weights: dict | None = None, tokenizer=None) -> None:
        if config.dtype not in DTYPES:
            raise InvalidParameterError(f"dtype must be one of {sorted(DTYPES)}, got {config.dtype}")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = DTYPES[config.dtype]
        if spec is None:
            from kvledger.engine.loader import load_tokenizer, load_weights

            spec, weights = load_weights(config.model, dtype)
            tokenizer = load_tokenizer(config.model)
        self.config, self.spec, self.tokenizer = config, spec, tokenizer
        # characters of the longest vocabulary entry: no token covers more text than that
        self._token_chars = max(map(len, tokenizer.get_vocab())) if tokenizer else 0
        self.model_name = _model_name(config.model)
        self.max_model_len = spec.max_position_embeddings
        self.model = LlamaModel(spec, weights, dtype)
        self.kv_format = KV_FORMAT_OF_DTYPE[dtype]
        self.bytes_per_block = kv_bytes_per_block(spec, config.block_size, self.kv_format)
        self.bytes_per_token = kv_bytes_per_token(spec, self.kv_format)
        num_blocks = self.store_blocks = self._pool_blocks()
        self.store = KVStore(spec.num_layers, num_blocks, config.block_size, spec.num_kv_heads,
                             spec.head_dim, dtype) if config.use_kv_cache else None
        self.runner = ModelRunner(self.model, self.store, config.block_size)
        self.scheduler = Scheduler(config, num_blocks, config.block_size, self.bytes_per_block,
                                   self.max_model_len)
        self.sampler = Sampler()
        self._requests: dict[str, _Request] = {}

    def _pool_blocks(self) -> int:
        c = self.config
        if c.num_blocks is not None:
            blocks = c.num_blocks
        elif c.kv_cache_gib is not None:
            blocks = int(c.kv_cache_gib * (1 << 30)) // self.bytes_per_block
        else:
            per_seq = -(-self.max_model_len // c.block_size)
            blocks = min(per_seq * c.max_num_seqs, DEFAULT_POOL_CAP_BYTES // self.bytes_per_block)
        if blocks < 1:
            raise KVBudgetError(
                f"KV budget too small: one block of {c.block_size} tokens needs "
                f"{self.bytes_per_block} bytes ({self.kv_format})")
        return blocks

    def tokenize(self, prompt: str | list[dict] | list[int]) -> list[int]:
        """Token ids of a text prompt, chat messages (chat template applied) or ids.

        Raises:
            ContextLengthError: the text is so long that even at the vocabulary's longest
                token it cannot fit the context; refused before the (slow) tokenization.
        """
        chars = _text_chars(prompt)
        if self.tokenizer is not None and chars > self.max_model_len * self._token_chars:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {chars} characters, so at least {chars // self._token_chars} tokens")
        return encode_prompt(self.tokenizer, prompt, self.spec.vocab_size)

    def add_request(self, request_id: str, prompt: str | list[int] | list[dict],
                    params: SamplingParams | None = None, cache_salt: str | None = None) -> None:
        """Queue a request.

        Raises:
            InvalidParameterError: empty prompt, bad token ids, duplicate request_id.
            ContextLengthError: prompt + max_tokens over the context (max_tokens None = up to it).
            KVBudgetError: the request can never fit the pool or its per-request KV quota.
        """
        params = params or SamplingParams()
        if request_id in self._requests:
            raise InvalidParameterError(f"request id {request_id!r} is already running")
        ids = self.tokenize(prompt)
        max_tokens = self._max_tokens(len(ids), params.max_tokens)
        seq = Sequence(request_id=request_id, prompt_token_ids=ids, params=params,
                       arrival_time=time.perf_counter(), max_tokens_effective=max_tokens,
                       cache_salt=cache_salt)
        self.scheduler.add(seq)
        out = RequestOutput(request_id=request_id, prompt_token_ids=ids,
                            logprobs=[] if params.logprobs is not None else None)
        out.metrics.arrival_time = seq.arrival_time
        out.metrics.num_prompt_tokens = len(ids)
        self._requests[request_id] = _Request(seq, IncrementalDetokenizer(self.tokenizer,
                                                                          params.stop), out)

    def _max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        limit = self.max_model_len
        if prompt_len >= limit:
            asked = "up to the limit" if max_tokens is None else str(max_tokens)
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{prompt_len} tokens (max_tokens {asked}; no room for one new token)")
        if max_tokens is None:  # "up to the limit": the context, the KV quota or the pool
            room = self._kv_token_room(prompt_len) - prompt_len
            if room < 1:
                raise KVBudgetError(
                    f"the prompt has {prompt_len} tokens and leaves no room for one new token "
                    "within the KV quota or pool (--max-kv-tokens-per-request, --kv-cache-gib)")
            return room
        if prompt_len + max_tokens > limit:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens; the prompt has "
                f"{prompt_len} tokens and max_tokens is {max_tokens} ({prompt_len + max_tokens} "
                "in total); shorten the prompt or lower max_tokens")
        return max_tokens

    def _kv_token_room(self, prompt_len: int) -> int:
        """Most tokens (prompt + output) one request may reach: context, quota, pool share."""
        c, sched = self.config, self.scheduler
        is_long = c.long_prompt_tokens is not None and prompt_len >= c.long_prompt_tokens
        blocks = sched.long_cap_blocks if is_long else self.store_blocks
        # the last sampled token is never fed back, so it needs no KV slot
        room = min(self.max_model_len, blocks * c.block_size + 1)
        return room if c.max_kv_tokens_per_request is None else min(
            room, c.max_kv_tokens_per_request)

    def abort(self, request_id: str) -> None:
        """Drop a request in any state; its KV blocks are free when this returns."""
        if self._requests.pop(request_id, None) is not None:
            self.scheduler.abort(request_id)
            self.sampler.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._requests)

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; one output per request that progressed or finished."""
        plan = self.scheduler.schedule()
        now = time.perf_counter()
        outputs = [self._fail(seq, err) for seq, err in plan.failed]
        if not plan.chunks:
            return outputs
        for chunk in plan.chunks:
            m = self._requests[chunk.seq.request_id].output.metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        sampling = [c.seq for c in plan.chunks if c.samples]
        logits = self.runner.execute(plan.chunks)
        tokens, logprobs = self.sampler.sample(
            logits, [s.request_id for s in sampling], [s.params for s in sampling])
        self.scheduler.advance(plan)
        now = time.perf_counter()
        for seq, token, lp in zip(sampling, tokens, logprobs):
            outputs.append(self._append(seq, token, lp, now))
        return outputs

    def _append(self, seq: Sequence, token: int, logprob, now: float) -> RequestOutput:
        req = self._requests[seq.request_id]
        out, m = req.output, req.output.metrics
        seq.output_token_ids.append(token)
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        m.num_cached_tokens = seq.num_cached_tokens
        m.peak_kv_bytes = seq.peak_num_blocks * self.bytes_per_block
        if logprob is not None:
            out.logprobs.append(logprob)
        new_text, stopped = req.detok.update(seq.output_token_ids)
        reason = "stop" if stopped else self._finish_reason(seq, token)
        if reason is not None:
            new_text += "" if stopped else req.detok.flush()
            self._finish(seq, reason, now)
        out.token_ids = list(seq.output_token_ids)
        out.new_token_ids = [token]
        out.text += new_text
        out.new_text = new_text
        return out

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and (token in self.spec.eos_token_ids or token in p.stop_token_ids):
            return "stop"
        if len(seq.output_token_ids) >= seq.max_tokens_effective:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        req = self._requests.pop(seq.request_id)
        req.output.finished, req.output.finish_reason = True, reason
        req.output.metrics.finished_time = now
        self.scheduler.finish(seq)
        self.sampler.forget(seq.request_id)

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        req = self._requests.pop(seq.request_id)
        self.sampler.forget(seq.request_id)
        out = req.output
        out.finished, out.finish_reason, out.error = True, "error", str(error)
        out.new_token_ids, out.new_text = [], ""
        out.metrics.finished_time = time.perf_counter()
        return out

    def stats(self) -> dict:
        """Scheduler and pool counters plus allocated vs ledger-predicted KV bytes."""
        s = self.scheduler.stats()
        in_use = s["kv_blocks_total"] - s["kv_blocks_free"]
        held = sum(r.seq.num_computed_tokens for r in self._requests.values())
        s["kv_bytes_allocated"] = in_use * self.bytes_per_block
        s["kv_bytes_predicted"] = held * self.bytes_per_token
        s["kv_pool_bytes"] = self.store.nbytes if self.store is not None else 0
        return s
