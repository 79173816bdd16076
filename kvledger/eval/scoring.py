"""Run a token sequence through the engine's cache path and return log-probabilities.

A chunk is fed as one request holding its own block table in the engine's KV pool, in steps of
``stride`` tokens: the first step is a prefill from an empty cache, later steps attend over
what the cache holds (a step of one token is a decode), exactly as generation would; under the
engine's retention policy (``--kv-policy``) the policy evicts between steps. Nothing
is put in the prefix cache, so every chunk starts cold. The scheduler is bypassed (one
request, no batching), the KV manager, store and attention backend are not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvledger.engine.config import EngineConfig
from kvledger.engine.request import Request
from kvledger.engine.sample.sampling_params import SamplingParams
from kvledger.errors import ContextLengthError, KVBudgetError


@dataclass
class _Chunk:
    request: Request
    num_new_tokens: int


def eval_config(config: EngineConfig, context: int) -> EngineConfig:
    """``config`` with a pool of exactly one ``context``-token sequence unless it names one."""
    if config.num_blocks is not None or config.kv_cache_gib is not None:
        return dataclasses.replace(config, max_num_seqs=1)
    blocks = -(-context // config.block_size)
    return dataclasses.replace(config, num_blocks=blocks, max_num_seqs=1)


def load_engines(config: EngineConfig, context: int, base_kv: str | None = None):
    """(engine, base engine or None) over one loaded model; the base differs in its KV
    format ``base_kv`` (the full-precision reference of ``--kl-divergence``) and keeps every
    token (full retention, whatever ``--kv-policy`` the engine has).

    Raises:
        ContextLengthError: ``context`` exceeds the model's context.
        plus what :class:`LLMEngine` raises for bad options or a missing model.
    """
    from kvledger.engine.engine import LLMEngine
    from kvledger.engine.model_load import compute_dtype
    from kvledger.model.weights.loader import load_tokenizer, load_weights

    spec, weights = load_weights(config.model, compute_dtype(config.dtype))
    if context > spec.max_position_embeddings:
        raise ContextLengthError(f"--context {context} exceeds the model's context of "
                                 f"{spec.max_position_embeddings} tokens")
    tokenizer = load_tokenizer(config.model)
    cfg = eval_config(config, context)
    engine = LLMEngine(cfg, spec=spec, weights=weights, tokenizer=tokenizer)
    base = None
    if base_kv is not None:
        full = {"kv_policy": None, "kv_window": None, "kv_sinks": None, "kv_budget": None,
                "kv_positions": None, "kv_select": None, "kv_scope": None,
                "kv_outlier_channels": 0, "kv_rotation": "none", "kv_key_group_tokens": None,
                "kv_residual_tokens": None, "kv_intact_tokens": 0}
        base = LLMEngine(dataclasses.replace(cfg, kv_cache_dtype=base_kv, **full), spec=spec,
                         weights=weights, tokenizer=tokenizer)
    return engine, base


def step_logprobs(engine, tokens: list[int], stride: int, first: int,
                  inspect: Callable[[Request], None] | None = None
                  ) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield ``(position, logprobs)`` per step: log-softmax [rows, vocab] (fp32) of the logits at
    positions ``position .. position + rows - 1``, for positions in ``[first, len(tokens) - 1)``
    (the logits at position p predict token p + 1). ``inspect(request)``, if given, runs once
    the whole chunk is in the cache, before its blocks are freed (calibration reads the K/V).

    Under a policy that compresses the prompt only (snapkv, ``--kv-scope prompt``) the
    request's prompt is ``tokens[:first]``, compressed once it is in (no step crosses it), and
    the rest is fed as its continuation: kvpress's shape. Otherwise the whole chunk is the
    prompt.

    Raises:
        KVBudgetError: the pool cannot hold the chunk (another request holds blocks).
    """
    spec = engine.config.retention
    prompt = first if spec.compresses_prompt and 0 < first < len(tokens) else len(tokens)
    req = Request("kvledger-eval", list(tokens[:prompt]), SamplingParams(max_tokens=1))
    req.output_token_ids = list(tokens[prompt:])
    # the engine's --kv-policy: eviction runs between steps, as in generation
    req.retention = engine.retention_state(spec)
    kv, end = engine.scheduler.kv, len(tokens) - 1
    steps = [(start, min(stride, hi - start)) for lo, hi in ((0, prompt), (prompt, len(tokens)))
             for start in range(lo, hi, stride)]
    try:
        for start, n in steps:
            if not kv.allocate_slots(req, n):
                raise KVBudgetError(f"the KV pool cannot hold a {len(tokens)}-token chunk")
            hidden = engine.runner.hidden_states([_Chunk(req, n)])
            req.num_computed_tokens += n
            req.retention.append(start, n)
            kv.retain(req)
            lo, hi = max(start, first), min(start + n, end)
            if lo < hi:
                logits = engine.model.compute_logits(hidden[lo - start: hi - start])
                yield lo, torch.log_softmax(logits, dim=-1)
        if inspect is not None:
            inspect(req)
    finally:
        kv.free(req)
