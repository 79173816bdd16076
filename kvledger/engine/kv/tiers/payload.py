"""A pool block's bytes as one payload, and back: what a KV tier stores per block.

The payload is every tensor of the store at the block's id, as raw bytes, in a fixed order:
K then V of each layer for a full-precision store (``store.py``), each layer's K codec fields
then V codec fields by name for a quantized one (``quantized_store.py``: codes, scales, zero
points, outliers). Its length is the ledger's bytes per block (``ledger.kv.kv_bytes_per_block``;
checked by :func:`payload_bytes`' caller). A quantized block is read only once full, when its
residual buffer is gone, so codes and scales are the whole block.
"""

from __future__ import annotations

import torch


def _tensors(store) -> list[torch.Tensor]:
    """The store's tensors indexed by block id, in payload order."""
    if store.quantized:
        return [layer[name] for parts in (store.key_parts, store.value_parts)
                for layer in parts for name in sorted(layer)]
    return [t for pair in zip(store.key_blocks, store.value_blocks) for t in pair]


def payload_bytes(store) -> int:
    """Bytes of one block's payload."""
    return sum(t[0].nbytes for t in _tensors(store))


def read_block(store, block_id: int) -> bytes:
    """Block ``block_id``'s payload (a copy)."""
    parts = [t[block_id].reshape(-1).view(torch.uint8) for t in _tensors(store)]
    return torch.cat(parts).numpy().tobytes()


def write_blocks(store, block_ids: list[int], payloads: list) -> None:
    """Copy payloads (bytes-like, writable) into blocks ``block_ids`` (fresh blocks with no
    residual buffer): one ``index_copy_`` per store tensor for all blocks.

    Raises:
        ValueError: a payload's length is not :func:`payload_bytes`.
    """
    size = payload_bytes(store)
    if any(len(p) != size for p in payloads):
        raise ValueError(f"a payload is not {size} bytes, what a block holds")
    if not block_ids:
        return
    rows = torch.stack([torch.frombuffer(p, dtype=torch.uint8) for p in payloads])
    ids = torch.tensor(block_ids, dtype=torch.int64)
    offset = 0
    for t in _tensors(store):
        dst = t.view(t.shape[0], -1).view(torch.uint8)  # [num_blocks, bytes of one block]
        width = dst.shape[1]
        dst.index_copy_(0, ids, rows[:, offset:offset + width])
        offset += width
