"""Read models of the scheduler: the KV pool and the queues as frozen data.

The server's dashboard, ``kvledger serve --trace`` and the replay read what they show through
:meth:`Scheduler.snapshot` (``LLMEngine.snapshot`` for an engine) instead of reaching through
``scheduler.kv.pool`` and the queues, so the scheduler and the KV manager may change inside.
A snapshot is taken in the engine's thread between two steps (the engine is single-threaded)
and never changes afterwards; it carries token counts and block ids only, never text.

Block states (``SchedulerSnapshot.block_states``, one per block id in order): ``BLOCK_USED`` (a reference
held), ``BLOCK_CACHED`` (free but still holding a prefix-cache hash), ``BLOCK_FREE`` (empty).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvledger.engine.request import NULL_BLOCK

BLOCK_USED, BLOCK_CACHED, BLOCK_FREE = "used", "cached", "free"


@dataclass(frozen=True)
class PoolStats:
    """The KV pool's block counts and sizes (cheap: no walk over the blocks)."""

    blocks_total: int
    blocks_free: int
    blocks_cached: int  # free blocks still in the prefix cache (evictable)
    blocks_in_use: int
    block_size: int  # tokens per block
    bytes_per_block: int  # the ledger's KV bytes of one block over all layers


@dataclass(frozen=True)
class RequestSnapshot:
    """One unfinished request: token counts, the blocks it holds, preemptions."""

    request_id: str
    state: str  # "running" or "waiting"
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache
    blocks_held: int
    block_ids: tuple[int, ...]  # every block of its tables, in table order
    max_total_tokens: int  # prompt + max_tokens: the most KV it may reach
    preemptions: int


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The pool, each block's state (``BLOCK_*``, by block id), the unfinished requests
    (running first, then waiting, in queue order) and the per-request KV quota in tokens (None
    when unset)."""

    pool: PoolStats
    block_states: tuple[str, ...]
    requests: tuple[RequestSnapshot, ...]
    quota_tokens: int | None


def _request(req: Any, state: str) -> RequestSnapshot:
    return RequestSnapshot(
        request_id=req.request_id, state=state, prompt_tokens=req.num_prompt_tokens,
        output_tokens=len(req.output_token_ids), computed_tokens=req.num_computed_tokens,
        cached_tokens=req.num_cached_tokens, blocks_held=req.num_blocks_held,
        block_ids=tuple(b for table in req.block_tables for b in table if b != NULL_BLOCK),
        max_total_tokens=req.max_total_tokens, preemptions=req.num_preemptions)


def pool_stats(scheduler: Any) -> PoolStats:
    """The pool figures of ``scheduler`` (a :class:`~kvledger.engine.sched.scheduler.Scheduler`)
    now."""
    pool = scheduler.kv.pool
    return PoolStats(blocks_total=pool.num_blocks, blocks_free=pool.num_free,
                     blocks_cached=pool.num_evictable, blocks_in_use=pool.num_in_use,
                     block_size=scheduler.block_size, bytes_per_block=scheduler.bytes_per_block)


def take_snapshot(scheduler: Any) -> SchedulerSnapshot:
    """The whole read model of ``scheduler`` now (walks every block and request)."""
    states = tuple(BLOCK_USED if b.ref_cnt else BLOCK_CACHED if b.block_hash is not None
                   else BLOCK_FREE for b in scheduler.kv.pool.blocks)
    return SchedulerSnapshot(
        pool=pool_stats(scheduler), block_states=states,
        requests=tuple([_request(r, "running") for r in scheduler.running]
                       + [_request(r, "waiting") for r in scheduler.waiting]),
        quota_tokens=scheduler.config.max_kv_tokens_per_request)


def scheduler_stats(scheduler: Any) -> dict:
    """KV pool and queue figures of ``scheduler`` as a flat dict (``/metrics`` and ``stats``
    names; kv_usage = in-use / total)."""
    pool = scheduler.kv.pool
    return {
        "kv_blocks_total": pool.num_blocks,
        "kv_blocks_free": pool.num_free,
        "kv_blocks_evictable": pool.num_evictable,
        "kv_blocks_touched": pool.num_touched,
        "kv_usage": pool.num_in_use / pool.num_blocks,
        "kv_bytes_per_block": scheduler.bytes_per_block,
        "prefix_cache_queried_tokens": scheduler.kv.prefix.queried_tokens,
        "prefix_cache_hit_tokens": scheduler.kv.prefix.hit_tokens,
        "prefix_cache_requeried_tokens": scheduler.kv.prefix.requeried_tokens,
        "prefix_cache_rehit_tokens": scheduler.kv.prefix.rehit_tokens,
        "prefix_cache_missed_tokens": scheduler.kv.prefix.missed_tokens,
        "num_preemptions": scheduler.num_preemptions,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
    }
