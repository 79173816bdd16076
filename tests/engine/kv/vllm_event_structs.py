"""vLLM's KV event structs, field for field (``vllm/distributed/kv_events.py`` at
vllm-project/vllm 0181ea3: ``EventBatch``, ``KVCacheEvent`` and its three events, msgspec
options included), in both layouts: ``array`` (``array_like=True`` on the events, vLLM before
its PR #42892) and ``map`` (after it). The batch is positional in both, as vLLM's publisher has
sent it. The test subscriber decodes with these, never with kvledger's encoder."""


from typing import Any

import msgspec

ExternalBlockHash = bytes | int


def structs(array_like: bool):
    """(KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared) for one layout."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False,
                       tag=True):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
