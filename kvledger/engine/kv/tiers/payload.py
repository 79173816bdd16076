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


def write_block(store, block_id: int, payload: bytearray) -> None:
    """Copy a payload into block ``block_id`` (a fresh block with no residual buffer).

    Raises:
        ValueError: the payload's length is not :func:`payload_bytes`.
    """
    tensors = _tensors(store)
    if len(payload) != payload_bytes(store):
        raise ValueError(f"payload of {len(payload)} bytes, a block holds {payload_bytes(store)}")
    src = torch.frombuffer(payload, dtype=torch.uint8)
    offset = 0
    for t in tensors:
        dst = t[block_id].reshape(-1).view(torch.uint8)
        dst.copy_(src[offset:offset + dst.numel()])
        offset += dst.numel()
