"""The retention a new request starts with, from its ``RetentionSpec``."""

from __future__ import annotations

import logging

from kvledger.engine.retention.full import FullRetention
from kvledger.engine.retention.interface import Retention
from kvledger.engine.retention.per_head import PerHeadKV
from kvledger.engine.retention.policies import RetentionPolicy, make_policy
from kvledger.engine.retention.state import RetainedKV
from kvledger.ledger.retention import RetentionSpec

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
