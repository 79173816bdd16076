"""LLMEngine: requests in, tokens out, one scheduler step at a time.

Each ``step()``: the scheduler picks chunks (continuous batching, chunked prefill, preemption)
and allocates their KV slots; the runner runs one forward over all of them; the sampler picks a
token for every request that reached its end; the detokenizer turns tokens into text and stop
conditions finish requests, whose blocks go back to the pool (full blocks stay in the prefix
cache). The pool is sized with the ledger's bytes per block (``kv/pool_size.py``), so the pool
tensors hold exactly what ``kvledger plan`` predicts. Each request is one ``Request`` object,
registered in ``scheduler.requests`` while it is unfinished. The engine is single-threaded:
callers serialize access.
"""

from __future__ import annotations

import logging
import time

import torch

from kvledger.device import resolve
from kvledger.engine.config import EngineConfig
from kvledger.engine.device_scope import refuse_off_cpu, refuse_policy_off_cpu
from kvledger.engine.kv.calibration import outlier_index
from kvledger.engine.kv.events.publisher import KVEventPublisher
from kvledger.engine.kv.layout import resolve_layout
from kvledger.engine.kv.pool_size import pool_blocks
from kvledger.engine.kv.state_store import releasing, state_config, state_layout
from kvledger.engine.kv.tiers.build import refuse_unsupported, tier_linker, weights_id_of
from kvledger.engine.kv.tiers.build import wanted as tiers_wanted
from kvledger.engine.kv.tiers.tier_dir import open_tier_dir
from kvledger.engine.model_load import (
    build_model,
    compute_dtype,
    load_model,
    model_name,
    model_spec,
)
from kvledger.engine.output.detokenizer import IncrementalDetokenizer
from kvledger.engine.output.emit import OutputEmitter
from kvledger.engine.output.request_output import RequestOutput
from kvledger.engine.parallel.group import TensorParallelError
from kvledger.engine.prompts import encode_prompt
from kvledger.engine.request import NULL_BLOCK, Request
from kvledger.engine.retention.build import check_retention, retention_for
from kvledger.engine.retention.interface import Retention
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sample.prompt_logprobs import PromptLogprobs
from kvledger.engine.sample.sampler import Sampler
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.engine.sample.structured.compiler import (
    GrammarCompiler,
    grammar_cache_bytes,
    grammar_limits,
)
from kvledger.engine.sched.output import SchedulerOutput
from kvledger.engine.sched.scheduler import Scheduler
from kvledger.engine.sched.snapshot import SchedulerSnapshot
from kvledger.engine.spec.draft_model import DraftModel, load_draft
from kvledger.engine.spec.gate import Gate, step_model
from kvledger.engine.spec.speculator import Speculator
from kvledger.engine.tuning.tuned import TunedDevice
from kvledger.errors import ContextLengthError, InvalidParameterError
from kvledger.ledger.kv_groups import describe_groups
from kvledger.ledger.retention import RetentionSpec
from kvledger.spec import ModelSpec

log = logging.getLogger("kvledger.engine")


def _text_chars(prompt) -> int:
    """Characters of a text prompt or of all chat messages' contents (0 for token ids)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(m["content"]) for m in prompt
                   if isinstance(m, dict) and isinstance(m.get("content"), str))
    return 0


class LLMEngine:
    """The inference engine over one model.

    Args:
        config: engine options (model path, dtype, pool size, scheduler limits).
        spec, weights, tokenizer: an already loaded model (tests); by default they are loaded
            from ``config.model``. ``tokenizer`` may be None for token-id-only use.

    Attributes:
        device: the device ``config.device`` names (``kvledger.device.resolve``), resolved
            once; ``tuned``: it with the probe's choices, which the model, the attention
            backend and the KV store are built with.

    Raises:
        ModelNotFoundError, ConfigError, UnsupportedModelError: the model cannot be loaded.
        InvalidParameterError: bad dtype or device. KVBudgetError: the pool has no room for
            one block.
    """

    def __init__(self, config: EngineConfig, spec: ModelSpec | None = None,
                 weights: dict | None = None, tokenizer=None) -> None:
        dtype = compute_dtype(config.dtype)
        self.device = resolve(config.device)
        self.tuned = TunedDevice(self.device)
        self._step_hook = self.device.threads(config.num_threads, config.tensor_parallel_size)
        self.parallel = None
        if config.tensor_parallel_size > 1:  # a torchrun rank > 0 serves inside start()
            from kvledger.engine.parallel.launch import TensorParallel
            self.parallel = TensorParallel.start(config, spec or model_spec(config), self.device)
        try:
            self._build(config, dtype, spec, weights, tokenizer)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, dtype: torch.dtype, spec, weights, tokenizer) -> None:
        self.tokenizer_note = None
        self.tiers = None
        # the disk tier's directory is created, checked and locked before the model loads
        self._tier_dir = open_tier_dir(config.kv_disk_dir) if config.kv_disk_dir else None
        weights_id = weights_id_of(config, weights) if tiers_wanted(config) else None
        if spec is None:
            spec, weights, tokenizer, self.tokenizer_note = load_model(config, dtype)
        state_config(config, spec)
        refuse_unsupported(config, spec)
        refuse_off_cpu(self.device.name, config, spec)
        self.config, self.spec, self.tokenizer = config, spec, tokenizer
        # characters of the longest vocabulary entry: no token covers more text than that
        self._token_chars = max(map(len, tokenizer.get_vocab())) if tokenizer else 0
        self.model_name = model_name(config.model, config.load_format)
        self.max_model_len = spec.max_position_embeddings
        self.kv_layout = resolve_layout(config, spec, dtype)
        tuned = self.tuned
        attention = config.attention or tuned.attention_backend(spec, self.kv_layout.quantized)
        if self.parallel is None:
            self.model = build_model(spec, weights, dtype, attention, device=tuned)
        else:
            self.model = self.parallel.build_model(spec, weights, dtype, attention, tuned)
        self.kv_format = self.kv_layout.kv_format
        self.bytes_per_block = self.kv_layout.bytes_per_block
        self.bytes_per_token = self.kv_layout.bytes_per_token
        state, config = state_layout(config, spec, dtype, self.model, self.bytes_per_block)
        self.config = config  # prefix caching off on a state model without checkpoints
        draft = load_draft(config, dtype, spec, tokenizer)  # its pool has as many blocks
        num_blocks = pool_blocks(
            config, (state.sizing_bytes_per_block(self.bytes_per_block) if state
                     else self.bytes_per_block) + (draft.bytes_per_block if draft else 0),
            self.max_model_len,
            self.kv_layout.reserved_bytes + (state.reserved_bytes if state else 0),
            self.kv_layout.groups)
        self.states = state.build(num_blocks) if state else None
        self.store = None
        # where the pool and each step's inputs live (None: the CPU's memory, as always)
        on_device = None if self.device.name == "cpu" else self.device.torch_device
        self.store_outliers = (outlier_index(config, spec, self.kv_layout)
                               if config.use_kv_cache else None)
        if config.use_kv_cache:
            self.store = self.kv_layout.build_store(num_blocks, self.store_outliers,
                                                    kernels=self.device.kernels,
                                                    device=on_device)
        if self.parallel is None:
            self.runner = ModelRunner(self.model, self.store, config.block_size, self.states,
                                      on_device)
        else:
            self.runner = self.parallel.runner(self.model, self.store, config, num_blocks)
        # compaction copies and block releases go to the store, or under tensor parallelism
        # through the runner to every rank's store
        store_ops = self.store if self.parallel is None or self.store is None else self.runner
        check_retention(config.retention, spec, self.kv_layout, self.store)
        self.kv_events = None
        if config.kv_events is not None:
            self.kv_events = KVEventPublisher(config.kv_events, config.block_size,
                                              self.kv_layout.groups)
        link_tiers = None
        if tiers_wanted(config):
            link_tiers = tier_linker(
                config, self._tier_dir, weights_id=weights_id,
                spec=spec, weight_formats=self.model.weight_formats,
                fmt_json=self.kv_layout.fmt.to_json(), outliers=self.store_outliers,
                bytes_per_block=self.bytes_per_block, store=self.store,
                events=self.kv_events and self.kv_events.hook)
        self.scheduler = Scheduler(config, num_blocks, config.block_size, self.bytes_per_block,
                                   self.max_model_len, store_ops, self.kv_layout.groups,
                                   self.kv_layout.sealed_blocks,
                                   len if self.store is None else self.store.shareable,
                                   self.kv_layout.intact_blocks,
                                   releasing(store_ops.release if self.store is not None
                                             else None, self.states),
                                   link_tiers, self.kv_events and self.kv_events.hook("pool"),
                                   self.states)
        self.tiers = self.scheduler.kv.tiers
        log.info("KV cache: %s, %d blocks of %d tokens, %d bytes each (+%d bytes of residual "
                 "blocks), %s", self.kv_layout.describe(), num_blocks, config.block_size,
                 self.bytes_per_block, self.kv_layout.reserved_bytes,
                 describe_groups(self.kv_layout.groups))
        self.grammars = (GrammarCompiler(tokenizer, spec.vocab_size, spec.eos_token_ids,
                                         grammar_limits(config), grammar_cache_bytes(config))
                         if tokenizer is not None else None)
        self.sampler = Sampler(self.grammars)
        self.emitter = OutputEmitter(spec.eos_token_ids, self.scheduler, self.grammars,
                                     self.bytes_per_block)
        self.speculator = self._speculator(config, draft and DraftModel(
            draft, num_blocks, config.attention, tuned))
        self.last_schedule: SchedulerOutput | None = None  # the latest step's plan (traces)

    def _speculator(self, config: EngineConfig, drafter: DraftModel | None) -> Speculator | None:
        """The speculative decoder of ``config.speculative`` (None when it is off; the config
        refused it with tensor parallelism or without the KV cache) with the draft model of
        method ``draft_model``."""
        spec = config.speculative
        if not spec.enabled:
            return None
        layout = self.kv_layout
        draft = drafter and step_model(drafter.spec, drafter.layout.fmt, drafter.block_size)
        gate = Gate(step_model(self.spec, layout.fmt, layout.block_size), draft, spec.gate)
        return Speculator(spec, self.scheduler, self.sampler, self.store, self.emitter.append,
                          gate, drafter)

    @property
    def cache_config(self) -> dict[str, str]:
        """The KV cache's configuration as strings (``/metrics``' ``cache_config_info`` labels,
        vLLM's names where it has them)."""
        layout = self.kv_layout
        return {"block_size": str(self.config.block_size), "cache_dtype": layout.kv_format,
                "kv_layout": layout.describe(), "num_blocks": str(self.scheduler.kv.pool.num_blocks),
                "bytes_per_block": str(self.bytes_per_block),
                "enable_prefix_caching": str(self.config.enable_prefix_caching)}

    def tokenize(self, prompt: str | list[dict] | list[int],
                 add_special_tokens: bool = True,
                 tools: list[dict] | None = None) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens unless
        ``add_special_tokens`` is False), chat messages (chat template applied, with ``tools``
        if given) or ids.

        Raises:
            ContextLengthError: the text is so long that even at the vocabulary's longest
                token it cannot fit the context; refused before the (slow) tokenization.
        """
        chars = _text_chars(prompt)
        if self.tokenizer is not None and chars > self.max_model_len * self._token_chars:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"prompt has {chars} characters, so at least {chars // self._token_chars} tokens")
        return encode_prompt(self.tokenizer, prompt, self.spec.vocab_size, add_special_tokens,
                             tools)

    def add_request(self, request_id: str, prompt: str | list[int] | list[dict],
                    params: SamplingParams | None = None, cache_salt: str | None = None) -> None:
        """Queue a request.

        All or nothing: every check runs before the request is registered, so an error leaves no
        state behind.

        Raises:
            InvalidParameterError: not a SamplingParams, a bad sampling value, empty prompt, bad
                token ids (also in ``logit_bias`` / ``stop_token_ids``), duplicate request_id.
            ContextLengthError: prompt + max_tokens over the context (max_tokens None = up to it).
            InvalidParameterError: ``structured_outputs`` that does not compile (the
                unsupported JSON Schema feature is named).
            KVBudgetError: the request can never fit the pool or its per-request KV quota.
            TensorParallelError: a tensor-parallel rank failed (``failure``).
        """
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        params.check_vocab(self.spec.vocab_size)
        spec = params.kv_policy or self.config.retention
        check_retention(spec, self.spec, self.kv_layout, self.store)
        ids = self.tokenize(prompt)
        grammar = self._grammar(params)
        req = Request(request_id, ids, params, cache_salt=cache_salt,
                      detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop),
                      retention=self.retention_state(spec))
        req.grammar = grammar
        self.scheduler.add(req)

    def _grammar(self, params: SamplingParams):
        """A new matcher of ``params.structured_outputs`` (None without one); the compiled
        grammar comes from ``self.grammars``' cache, else it is compiled now.

        Raises:
            InvalidParameterError: no tokenizer, or the constraint does not compile.
        """
        if params.structured_outputs is None:
            return None
        if self.grammars is None:
            raise InvalidParameterError("structured output needs the model's tokenizer")
        return self.grammars.matcher(params.structured_outputs)

    def retention_state(self, spec: RetentionSpec) -> Retention:
        """A new request's retention under ``spec`` (``engine/retention/build.py``; per
        (layer, KV head) rows of this model when it selects per head).

        Raises:
            InvalidParameterError: a policy the engine's device does not run
                (``device_scope.py``)."""
        refuse_policy_off_cpu(self.device.name, spec.policy)
        return retention_for(spec, self.config.block_size, self.spec.num_layers,
                             self.spec.num_kv_heads, tensor_parallel=self.parallel is not None)

    @property
    def failure(self) -> str | None:
        """Why the engine cannot compute any more (a tensor-parallel rank died or hung), else
        None. Once set, ``add_request`` and ``step`` raise TensorParallelError (HTTP 503)."""
        return None if self.parallel is None else self.parallel.failure

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at interpreter exit); write
        what the KV tiers have queued and release the disk tier's directory."""
        if getattr(self, "tiers", None) is not None:
            self.tiers.chain.close()
        if getattr(self, "_tier_dir", None) is not None:
            self._tier_dir.close()
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()
        if self.parallel is not None:
            self.parallel.close()

    def abort(self, request_id: str) -> None:
        """Drop a request in any state; its KV blocks (and a draft model's) are free when this
        returns."""
        self.scheduler.abort(request_id)
        if self.speculator is not None and self.speculator.drafter is not None:
            self.speculator.drafter.release(request_id)

    def reset_prefix_cache(self) -> int:
        """Drop every evictable block from the prefix cache; no block in use is touched.
        Returns the blocks dropped (``BlockPool.evict_free_cached``)."""
        return self.scheduler.kv.pool.evict_free_cached()

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running (``Scheduler.has_unfinished_requests``)."""
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; one output per request that progressed or finished."""
        self._step_hook.before_step()  # in the thread that steps (the CPU: OpenMP's ICV)
        plan = self.last_schedule = self.scheduler.schedule()
        now = time.perf_counter()
        outputs = [self.emitter.fail(req, err) for req, err in plan.failed]
        if not plan.chunks:
            return outputs
        for chunk in plan.chunks:
            m = chunk.request.metrics
            m.first_scheduled_time = m.first_scheduled_time or now
        if self.speculator is not None:
            self.speculator.draft(plan)
        logits = self.runner.execute(plan.chunks, PromptLogprobs(plan.chunks))
        if self.speculator is not None:
            outputs.extend(self.speculator.emit(plan, logits))
            return outputs
        sampling = [c.request for c in plan.chunks if c.samples]
        tokens, logprobs = self.sampler.sample(logits, sampling)
        self.scheduler.advance(plan)
        now = time.perf_counter()
        for req, token, lp in zip(sampling, tokens, logprobs):
            outputs.append(self.emitter.append(req, token, lp, now))
        return outputs

    def _distinct_kv_tokens(self) -> int:
        """Tokens with K/V in the cache (kept ones, under an evicting policy), each shared
        block counted once; a model of several layer groups counts each group's blocks
        (a page is one group's block, so a token there costs ``bytes_per_token / groups``)."""
        bs, filled = self.config.block_size, {}
        for req in self.scheduler.requests.values():
            held = req.retention.held_per_block(req.num_computed_tokens, bs)
            for table in req.block_tables:
                for block, n in zip(table, held):
                    if n > 0 and block != NULL_BLOCK:
                        filled[block] = max(filled.get(block, 0), n)
        return sum(filled.values())

    def snapshot(self) -> SchedulerSnapshot:
        """The KV pool and the queues as a frozen read model (``engine/sched/snapshot.py``)."""
        return self.scheduler.snapshot()

    def stats(self) -> dict:
        """Scheduler and pool counters plus allocated vs ledger-predicted KV bytes.

        ``kv_bytes_predicted`` is the ledger's bytes per token times the distinct tokens held:
        a prefix block shared by several requests is counted once (the ledger's
        ``--shared-prefix`` rule), so the prediction never exceeds what is allocated.
        """
        s = self.scheduler.stats()
        in_use = s["kv_blocks_total"] - s["kv_blocks_free"]
        held = self._distinct_kv_tokens()
        s["kv_bytes_allocated"] = in_use * self.bytes_per_block
        s["kv_bytes_predicted"] = held * self.bytes_per_token // max(1, len(self.kv_layout.groups))
        s["kv_pool_bytes"] = self.store.nbytes if self.store is not None else 0
        if self.states is not None:  # the state layers' slots, beside the blocks
            s["state_pool_bytes"] = self.states.nbytes
            s["state_slots_free"] = self.states.num_free
        if self.parallel is not None:  # every rank's store, rank 0 first
            s["kv_pool_bytes_per_rank"] = list(self.parallel.kv_pool_bytes)
        if self.tiers is not None:
            s.update(self.tiers.stats())
        if self.grammars is not None:
            s["grammar_cache_bytes"] = self.grammars.cache.nbytes
        if self.speculator is not None:
            s.update(self.speculator.stats())
        return s
