"""vLLM's KV event batch as bytes on the wire.

What vLLM encodes (``vllm/distributed/kv_events.py``, read at vllm-project/vllm commit
0181ea3173e53eea8cf04a86891488e3dc89bb34 and, for the positional layout, b4e69e0): msgspec
structs packed as MessagePack. The batch is ``[ts, events, data_parallel_rank]`` (an array: the
publisher always sets the rank, 0 here). Each event is tagged with its class name and its
fields in declaration order:

* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, then with defaults extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window;
* ``BlockRemoved``: block_hashes, medium, then group_idx;
* ``AllBlocksCleared``: no field.

``omit_defaults`` drops a defaulted field whose value is its default (None): in the positional
(``array``) layout only trailing ones, the tag first (``["BlockStored", [...], ...]``); in the
``map`` layout each, the tag under ``"type"``. A block hash goes out as vLLM's default
``ExternalBlockHash``: the low 64 bits of the sha256 digest read big-endian
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: the 32 bytes themselves).
"""

from __future__ import annotations

import os

import msgspec

# tag -> (fields without a default, fields defaulting to None), vLLM's declaration order
EVENT_FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "BlockStored": (("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                     "medium", "lora_name"),
                    ("extra_keys", "group_idx", "kv_cache_spec_kind",
                     "kv_cache_spec_sliding_window")),
    "BlockRemoved": (("block_hashes", "medium"), ("group_idx",)),
    "AllBlocksCleared": ((), ()),
}
INT_HASHES = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") != "0"


def external_hash(digest: bytes) -> int | bytes:
    """vLLM's ``maybe_convert_block_hash``: the low 64 bits as an int, or the bytes."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1) if INT_HASHES else digest


def event(tag: str, values: dict, array_like: bool) -> list | dict:
    """One event as vLLM's msgspec struct encodes it (module docstring)."""
    required, defaulted = EVENT_FIELDS[tag]
    if not array_like:
        out = {"type": tag}
        out.update((name, values.get(name)) for name in required)
        out.update((name, values[name]) for name in defaulted if values.get(name) is not None)
        return out
    tail = [values.get(name) for name in defaulted]
    while tail and tail[-1] is None:
        tail.pop()
    return [tag, *(values.get(name) for name in required), *tail]


class BatchEncoder:
    """Encodes batches ``[ts, events, data_parallel_rank]``."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: list) -> bytes:
        return self._encoder.encode([ts, events, self.rank])
