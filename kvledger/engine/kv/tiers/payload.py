"""A pool block's bytes as one payload, and back: what a KV tier stores per block.

The payload is every tensor of the store at the block's id, as raw bytes, in a fixed order:
K then V of each layer for a full-precision store (``store.py``), each layer's K codec fields
then V codec fields by name for a quantized one (``quantized_store.py``: codes, scales, zero
points, outliers); its length is the ledger's bytes per block (``ledger.kv.kv_bytes_per_block``).
A quantized block is cached, and so read, only once final, in one of two kinds:

- *sealed*: its codes and scales. With keys grouped over k > 1 blocks a block holds only a
  slice of its group's key scales and zero points, so the payload ends with a *group tag*
  (:data:`TAG_BYTES`): a digest of the whole group's split fields, the same in each of the k
  blocks sealed together. A group is restored only whole and only when its k tags agree with
  what the restored blocks hold (:func:`write_blocks`): blocks of two sealings of the same
  tokens (two requests, or a tier that evicted one block of a group and later took its
  twin) are never paired.
- *intact* (a sequence's first ``KVFormatSpec.intact_blocks``): never quantized, it lives in
  a residual buffer in the compute dtype; the payload is K then V of each layer's buffer rows,
  and restoring it takes a free buffer.

A block's position in its sequence says which kind it is (its prefix hash fixes the position,
and the engine's fingerprint the layout), so a payload of the other kind's length is refused.
"""

from __future__ import annotations

import hashlib

import torch

TAG_BYTES = 16


def _tensors(store) -> list[torch.Tensor]:
    """The store's tensors indexed by block id, in payload order."""
    if store.quantized:
        return [layer[name] for parts in (store.key_parts, store.value_parts)
                for layer in parts for name in sorted(layer)]
    return [t for pair in zip(store.key_blocks, store.value_blocks) for t in pair]


def _buffers(store) -> list[torch.Tensor]:
    """A quantized store's residual buffers indexed by slot, in an intact payload's order."""
    return [t for pair in zip(store.residual_keys, store.residual_values) for t in pair]


def _grouped(store) -> bool:
    return store.quantized and store.key_group_blocks > 1


def _intact(store) -> int:
    return store.intact_blocks if store.quantized else 0


def block_bytes(store) -> int:
    """Bytes of one pool block's tensors: the ledger's bytes per block."""
    return sum(t[0].nbytes for t in _tensors(store))


def payload_bytes(store, index: int | None = None) -> int:
    """Bytes of the payload of the block at position ``index`` of its sequence (None: a
    sealed block's, :func:`block_bytes` and the group tag; an intact block's are larger)."""
    if index is not None and index < _intact(store):
        return sum(t[0].nbytes for t in _buffers(store))
    return block_bytes(store) + (TAG_BYTES if _grouped(store) else 0)


def payload_sizes(store) -> tuple[int, ...]:
    """The lengths a block's payload may have (sealed, then intact when the format keeps
    intact blocks)."""
    return (payload_bytes(store),) + ((payload_bytes(store, 0),) if _intact(store) else ())


def whole_groups(store, first: int, count: int) -> int:
    """Leading blocks of a sequence's blocks ``first`` .. ``first + count - 1`` that end on
    a key-group boundary (after the intact blocks; ``first`` is on one)."""
    if not _grouped(store) or first + count <= _intact(store):
        return count
    n, k = _intact(store), store.key_group_blocks
    return max(n - first, (first + count - n) // k * k + n - first)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().reshape(-1).view(torch.uint8)


def group_tag(store, block_id: int) -> bytes:
    """Digest of the key-group fields of every block sealed with ``block_id`` (its
    ``group_members``), over all layers."""
    members = store.group_members[block_id]
    digest = hashlib.blake2b(digest_size=TAG_BYTES)
    for parts, codec in zip(store.key_parts, store.key_codecs):
        for name in codec.group_fields:
            digest.update(_as_bytes(parts[name].index_select(0, members)).numpy().tobytes())
    return digest.digest()


def read_block(store, block_id: int) -> bytes:
    """Block ``block_id``'s payload (a copy); the block is cached (sealed, or intact in its
    buffer)."""
    if store.quantized and int(store.residual_of[block_id]) >= 0:
        slot = int(store.residual_of[block_id])
        return torch.cat([_as_bytes(t[slot]) for t in _buffers(store)]).numpy().tobytes()
    parts = [_as_bytes(t[block_id]) for t in _tensors(store)]
    tag = group_tag(store, block_id) if _grouped(store) else b""
    return torch.cat(parts).numpy().tobytes() + tag


def _copy_rows(tensors: list[torch.Tensor], ids: list[int], payloads: list) -> None:
    """Payload bytes into rows ``ids`` of ``tensors`` (one ``index_copy_`` per tensor)."""
    rows = torch.stack([torch.frombuffer(p, dtype=torch.uint8) for p in payloads])
    index = torch.tensor(ids, dtype=torch.int64)
    offset = 0
    for t in tensors:
        dst = t.view(t.shape[0], -1).view(torch.uint8)  # [rows, bytes of one row]
        width = dst.shape[1]
        dst.index_copy_(0, index, rows[:, offset:offset + width])
        offset += width


def write_blocks(store, block_ids: list[int], payloads: list, first: int = 0) -> int:
    """Copy payloads (bytes-like, writable) of a sequence's blocks ``first``,
    ``first + 1``, ... into fresh pool blocks ``block_ids`` (no residual buffer); returns how
    many leading blocks hold what was stored: it stops at a payload of the wrong length for
    its position, at an intact block when no residual buffer is free, and before a key group
    that is not whole among the payloads or whose blocks' tags disagree with what they hold
    (each group's ``group_members`` are set to its fresh blocks)."""
    n = min(len(block_ids), len(payloads))
    sizes = [payload_bytes(store, first + i) for i in range(n)]
    n = next((i for i in range(n) if len(payloads[i]) != sizes[i]), n)
    intact = max(0, min(n, _intact(store) - first))
    if intact:
        slots = store.open_buffers(block_ids[:intact])
        if len(slots) < intact:
            n = intact = len(slots)  # no buffer for the next intact block
        if slots:
            _copy_rows(_buffers(store), slots, payloads[:intact])
    sealed_ids, sealed = block_ids[intact:n], payloads[intact:n]
    if not _grouped(store):
        if sealed_ids:
            _copy_rows(_tensors(store), sealed_ids, sealed)
        return n
    k = store.key_group_blocks
    whole = len(sealed_ids) // k * k
    if not whole:
        return intact
    _copy_rows(_tensors(store), sealed_ids[:whole], [p[:-TAG_BYTES] for p in sealed[:whole]])
    ids = torch.tensor(sealed_ids[:whole], dtype=torch.int64)
    store.group_members[ids] = ids.view(-1, k).repeat_interleave(k, 0)
    for g in range(whole // k):
        tags = {bytes(p[-TAG_BYTES:]) for p in sealed[g * k:(g + 1) * k]}
        if tags != {group_tag(store, sealed_ids[g * k])}:
            return intact + g * k
    return intact + whole
