"""The retention a new request starts with, from its ``RetentionSpec``, and the check that
the model can run it."""

from __future__ import annotations

import logging

from kvledger.engine.retention.full import FullRetention
from kvledger.engine.retention.interface import Retention
from kvledger.engine.retention.per_head import PerHeadKV
from kvledger.engine.retention.policies import RetentionPolicy, make_policy
from kvledger.engine.retention.state import RetainedKV
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv_groups import describe_groups
from kvledger.ledger.retention import RetentionSpec
from kvledger.spec import MLA, SLIDING, ModelSpec

log = logging.getLogger("kvledger.engine")


def retention_for(spec: RetentionSpec, block_size: int, layers: int = 1, kv_heads: int = 1,
                  tensor_parallel: bool = False, policy: RetentionPolicy | None = None
                  ) -> Retention:
    """A new request's retention under ``spec``: :class:`FullRetention` when it keeps every
    token, :class:`PerHeadKV` (``layers`` x ``kv_heads`` rows) when it selects per head, else
    :class:`RetainedKV`, over ``policy`` (default: ``make_policy(spec)``). Under tensor
    parallelism per-head selection falls back to per-sequence (logged): a rank holds only its
    KV heads, and the compaction moves and scores are made on rank 0 for all of them."""
    if not spec.evicts:
        return FullRetention()
    policy = make_policy(spec) if policy is None else policy
    if spec.select == "per-head" and tensor_parallel:
        log.info("kv_select per-head falls back to per-sequence under tensor parallelism")
    elif spec.select == "per-head":
        return PerHeadKV(policy, block_size, layers, kv_heads)
    return RetainedKV(policy, block_size)


def check_retention(spec: RetentionSpec, model: ModelSpec, kv_layout, store) -> None:
    """Refuse a ``spec`` that evicts where compaction cannot run: state layers, MLA, sliding
    layers, no KV cache (``store`` None) or a quantized pool (``kv_layout``: the engine's
    ``KVLayout``).

    Raises:
        InvalidParameterError: naming the model's obstacle and ``kv_policy full``.
    """
    if spec.evicts and model.state_layers:
        raise InvalidParameterError(
            f"kv_policy {spec.policy!r} does not run on a model with state layers "
            f"({model.model_type}: {len(model.state_layers)} of "
            f"{model.num_layers}); use kv_policy full")
    if spec.evicts and MLA in model.layers.types:
        raise InvalidParameterError(
            f"kv_policy {spec.policy!r} does not run on MLA (multi-head latent attention, "
            f"{model.model_type}) yet: its latent pool is kept whole; use kv_policy full")
    if spec.evicts and SLIDING in model.layers.types:
        raise InvalidParameterError(
            f"kv_policy {spec.policy!r} does not run on a model with sliding-window layers "
            f"yet ({model.model_type}: {model.layers.types.count(SLIDING)} of "
            f"{model.num_layers} layers slide, KV layout of "
            f"{describe_groups(kv_layout.groups)}); use kv_policy full")
    if spec.evicts and store is None:
        raise InvalidParameterError(
            f"kv_policy {spec.policy!r} needs the KV cache (it was turned off: --no-kv-cache)")
    if spec.evicts and store is not None and store.quantized:
        raise InvalidParameterError(
            f"kv_policy {spec.policy!r} runs on full-precision KV (fp32, bf16, fp16) for now, "
            f"not {kv_layout.kv_format} (compaction rewrites slots inside quantized blocks)")
