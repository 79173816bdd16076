"""A quantized block's tier payload (``engine/kv/tiers/payload.py``): intact blocks as their
buffer rows, grouped keys with a group tag. Restored into another store, the blocks read back
exactly what the first store reads (the oracle: the store's own read-back); a group of two
sealings, a payload of the wrong kind for its position, or no free buffer stops the restore."""

from __future__ import annotations

import torch

from kvledger.engine.kv.codecs import make_codecs
from kvledger.engine.kv.quantized_store import QuantizedKVStore
from kvledger.engine.kv.tiers.payload import (
    TAG_BYTES,
    block_bytes,
    payload_bytes,
    read_block,
    whole_groups,
    write_blocks,
)
from kvledger.ledger.kv_format import KVFormatSpec

BS, HEADS, DIM = 4, 2, 16
FMT = KVFormatSpec("int2", key_group_tokens=2 * BS, residual_tokens=2 * BS, intact_tokens=BS)
SEQ = [5, 0, 9, 3, 7, 2, 11, 4]  # blocks 0-1 intact (rounded to a key group), groups of 2


def _store(slots: int | None = None) -> QuantizedKVStore:
    keys, values = make_codecs("int2", BS, HEADS, DIM, 8, "per-channel", key_group_blocks=2)
    return QuantizedKVStore(2, 16, BS, HEADS, DIM, "int2", keys, values, torch.float32,
                            FMT.reserved_blocks(BS) if slots is None else slots, fmt=FMT)


def _written(seed: int) -> QuantizedKVStore:
    """A store holding one sequence of 8 blocks at SEQ: the first 2 intact, the rest sealed."""
    store, g = _store(), torch.Generator().manual_seed(seed)
    slots = (torch.tensor(SEQ)[:, None] * BS + torch.arange(BS)).flatten()
    for layer in range(2):
        store.write(layer, slots, *(torch.randn(8 * BS, HEADS, DIM, generator=g) for _ in "kv"),
                    torch.tensor(SEQ[2:]))
    return store


def _read(store, ids):
    return [torch.cat(store.read_blocks(layer, torch.tensor(ids))) for layer in range(2)]


def test_restored_blocks_read_back_what_the_pool_held():
    src = _written(1)
    payloads = [read_block(src, b) for b in SEQ]
    assert [len(p) for p in payloads] == [payload_bytes(src, i) for i in range(8)]
    assert len(payloads[0]) == 2 * 2 * BS * HEADS * DIM * 4  # K and V rows of 2 layers, fp32
    assert len(payloads[2]) == block_bytes(src) + TAG_BYTES
    dst, fresh = _store(), [1, 2, 3, 4, 6, 8, 10, 12]
    assert write_blocks(dst, fresh, [bytearray(p) for p in payloads]) == 8
    for want, got in zip(_read(src, SEQ), _read(dst, fresh)):
        assert torch.equal(want, got)
    assert dst.shareable(fresh) == 8


def test_a_group_of_two_sealings_a_wrong_payload_or_no_buffer_stops_the_restore():
    mine, theirs = _written(1), _written(2)
    payloads = [bytearray(read_block(mine, b)) for b in SEQ]
    mixed = payloads[:5] + [bytearray(read_block(theirs, SEQ[5]))] + payloads[6:]
    assert write_blocks(_store(), list(range(1, 9)), mixed) == 4  # blocks 4-5 mix sealings
    wrong = payloads[:3] + [payloads[0]] + payloads[4:]  # an intact payload at position 3
    assert write_blocks(_store(), list(range(1, 9)), wrong) == 2
    assert write_blocks(_store(slots=1), list(range(1, 9)), payloads) == 1  # one free buffer
    tail = _store()  # blocks 2.. on a hit of blocks 0-1: the first group follows
    assert write_blocks(tail, [1, 2, 3, 4, 5], payloads[2:7], first=2) == 4  # whole groups
    assert (whole_groups(tail, 0, 5), whole_groups(tail, 2, 5), whole_groups(tail, 0, 1)) \
        == (4, 4, 1)
