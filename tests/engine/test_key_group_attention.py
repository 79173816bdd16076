"""The native kernel over keys grouped over several blocks (KIVI key groups, ``GroupedKeys``)
and the full-precision window, driven step by step as the runner drives the store.

Four sequences of different lengths run chunked prefill (chunks of 40 tokens, so chunks and
key groups straddle each other), then decode together; their lengths are set so that their
key groups seal at different decode steps (group boundaries mid-batch), and one sequence stays
shorter than the window. After every step each backend attends over the store: paged-native
(its paged-torch fallback removed, so a format it could not decode fails here) and
paged-torch.

Oracle: float64 softmax attention over the K/V the store's ``read_blocks`` returns (the
codec's ``decode``, tested against KIVI's per-channel formula in tests/engine/kv/
test_kv_window.py, and the window's buffers; rotation undone there). In fp32 with a x20 key
channel the kernel stays within 2e-5 of it (measured up to 1.0e-5, int2 with its wide steps)
and paged-torch within 4e-5 (measured up to 1.7e-5).
"""

from __future__ import annotations

import pytest
import torch

from kvledger.device import resolve
from kvledger.engine.attention import AttentionMetadata, PrefillSegment, make_backend
from kvledger.engine.attention.layer import LayerAttention
from kvledger.engine.kv.codecs import make_codecs
from kvledger.engine.kv.quantized_store import QuantizedKVStore
from kvledger.engine.kv.rotation import rotation_matrix
from kvledger.engine.runner import _decode_group, _prefix_causal_mask
from kvledger.ledger.kv_format import KVFormatSpec

KERNELS = resolve("cpu").kernels

BLOCK, KV_HEADS, HEADS, DIM = 16, 3, 9, 64
CHUNK, DECODES = 40, 12


def _store(fmt: KVFormatSpec, seqs: int, rotation: str) -> QuantizedKVStore:
    k = fmt.key_group_blocks(BLOCK)
    keys, values = make_codecs(fmt.name, BLOCK, KV_HEADS, DIM, 32, "per-channel",
                               key_group_blocks=k)
    return QuantizedKVStore(1, 256, BLOCK, KV_HEADS, DIM, fmt.name, keys, values,
                            torch.float32, seqs * fmt.residual_blocks(BLOCK),
                            rotation=rotation_matrix(rotation, DIM), fmt=fmt)


def _native():
    backend = make_backend("paged-native", KERNELS)
    assert backend.name == "paged-native"
    backend._fallback = None  # no silent hand-over to paged-torch
    return backend


def _read(store, tables: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per table, its K and V [positions, heads, D] in float64 (read back in one call)."""
    k, v = (x.reshape(len(tables), -1, KV_HEADS, DIM).double()
            .repeat_interleave(HEADS // KV_HEADS, 2) for x in store.read_blocks(
                0, torch.stack(tables)))
    return list(zip(k, v))


def _exact(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], lens: list[int]
           ) -> torch.Tensor:
    """float64 attention of q[i] over the first lens[i] positions of K/V ``kv``."""
    k, v = kv
    scores = torch.einsum("qhd,nhd->qhn", q.double(), k) / DIM ** 0.5
    hidden = torch.arange(len(k))[None, :] >= torch.tensor(lens)[:, None]
    p = scores.masked_fill(hidden[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("qhn,nhd->qhd", p, v)


def _slots(table: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    pos = torch.arange(lo, hi)
    return table[pos // BLOCK] * BLOCK + pos % BLOCK


def _check(q, meta, store, want):
    empty = torch.empty(0, KV_HEADS, DIM)
    for backend, bound in ((_native(), 2e-5), (make_backend("paged-torch", KERNELS), 4e-5)):
        got = backend(0, q, empty, empty, meta, store)
        err = float((got.double() - want).abs().max())
        assert err <= bound, (backend.name, err)


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
@pytest.mark.parametrize("window", ["group", 128])
@pytest.mark.parametrize("group_blocks", [1, 2, 4])
@pytest.mark.parametrize("name", ["int4", "int3", "int2"])
def test_native_kernel_reads_key_groups_and_the_window_step_by_step(name, group_blocks,
                                                                    window, rotation):
    group = group_blocks * BLOCK
    r = group if window == "group" else window
    fmt = KVFormatSpec(name, key_group_tokens=group, residual_tokens=r)
    # a group seals when a length reaches R modulo G: at decode step 3, 8, 11, and never
    lengths = [r + group - 3, r + 2 * group - 8, 2 * r + group - 11, r - DECODES - 3]
    store = _store(fmt, len(lengths), rotation)
    assert store.key_group_blocks == group_blocks
    assert _native().reader(store) == "paged-native"  # the TPOT table's backend column
    ids = torch.randperm(256, generator=torch.Generator().manual_seed(group + r))
    blocks = -(-(max(lengths) + DECODES) // BLOCK)  # one table width: read back at once
    tables = [ids[i * blocks:(i + 1) * blocks] for i in range(len(lengths))]
    g = torch.Generator().manual_seed(7)
    done = [0] * len(lengths)
    sealed_at_decode = set()
    while any(d < n for d, n in zip(done, lengths)) or min(done) < min(lengths) + DECODES:
        prefill = any(d < n for d, n in zip(done, lengths))
        new = [min(CHUNK, n - d) for d, n in zip(done, lengths)] if prefill else [1] * 4
        slots = torch.cat([_slots(t, d, d + c) for t, d, c in zip(tables, done, new)])
        seal = torch.cat([t[fmt.sealed_blocks(d, BLOCK):fmt.sealed_blocks(d + c, BLOCK)]
                          for t, d, c in zip(tables, done, new)])
        k = torch.randn(len(slots), KV_HEADS, DIM, generator=g)
        k[..., 5] *= 20.0  # an outlier channel: per-channel scales matter
        store.write(0, slots, k, torch.randn(len(slots), KV_HEADS, DIM, generator=g), seal)
        if not prefill:
            sealed_at_decode |= {i for i, d in enumerate(done)
                                 if fmt.sealed_blocks(d + 1, BLOCK) > fmt.sealed_blocks(d, BLOCK)}
        done = [d + c for d, c in zip(done, new)]
        q = torch.randn(sum(new), HEADS, DIM, generator=g)
        kv = _read(store, tables)
        if prefill:
            start, segs, want = 0, [], []
            for i, (t, d, c) in enumerate(zip(tables, done, new)):
                if not c:
                    continue
                segs.append(PrefillSegment(start, c, _slots(t, 0, d),
                                           _prefix_causal_mask(d - c, c)))
                want.append(_exact(q[start:start + c], kv[i], list(range(d - c + 1, d + 1))))
                start += c
            meta = AttentionMetadata(None, prefills=segs)
            _check(q[:start], meta, store, torch.cat(want))
        else:
            meta = AttentionMetadata(None, decodes=[_decode_group(
                0, [_slots(t, 0, d) for t, d in zip(tables, done)])])
            _check(q, meta, store, torch.cat([_exact(q[i:i + 1], kv[i], [d])
                                              for i, d in enumerate(done)]))
    assert store.sealed_blocks(lengths[3] + DECODES) == 0  # one sequence never sealed
    assert sealed_at_decode == {0, 1, 2}  # three sequences sealed a group while decoding


def test_reader_keeps_a_soft_capped_layer_on_the_kernel():
    """A soft-capped layer (Gemma 2) is attended by the native kernel itself: the reader names
    no layer handed to paged-torch (it named 1 of 1 before the kernel took the soft-cap)."""
    store = _store(KVFormatSpec("int2"), 1, "none")
    backend = make_backend("paged-native", KERNELS)
    backend.set_layers([LayerAttention(0.125, softcap=30.0)])
    assert backend.reader(store) == "paged-native"
    assert make_backend("paged-torch", KERNELS).reader(store) == "paged-torch"
