"""The Triton paged-attention kernel against the reference backend's attention (gather the
context, then ``engine/attention/reference.py``'s SDPA or written-out scores): GQA, block
tables out of order, sliding windows, soft-caps, sink logits, split-KV, prefill queries over
a cached prefix, bf16, int and fp8 pools with a residual block. Under the interpreter on CPU tensors, or on a GPU (``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[cuda]')")

from kvledger.device.cuda.triton_kernels.paged_attention import (
    QuantizedSide,
    choose_splits,
    paged_attention,
    paged_attention_quantized,
)
from kvledger.engine.attention.layer import LayerAttention
from kvledger.engine.attention.reference import _attend
from kvledger.engine.kv.codec_numbers import codec_numbers
from kvledger.engine.kv.codecs import Fp8Codec, IntCodec

pytestmark = pytest.mark.triton


def _case(dev, lens, heads=4, kv_heads=2, dim=16, bs=4, dtype=torch.float32, seed=0):
    """Random pool, one shuffled block table per context length, one query per length."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // bs) for n in lens]
    blocks = sum(per_seq) + 3
    keys = torch.randn(blocks, bs, kv_heads, dim, generator=g).to(dtype)
    values = torch.randn(blocks, bs, kv_heads, dim, generator=g).to(dtype)
    ids = torch.randperm(blocks, generator=g)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int32)
    used = 0
    for row, count in enumerate(per_seq):
        tables[row, :count] = ids[used:used + count]
        used += count
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    to = {"device": dev}
    return (q.to(**to), keys.to(**to), values.to(**to), tables.to(**to),
            torch.arange(len(lens), dtype=torch.int32, device=dev),
            torch.tensor(lens, dtype=torch.int32, device=dev))


def _oracle(q, keys, values, tables, seqs, lens, how: LayerAttention):
    """Each query over its context gathered dense, by the reference backend's attention."""
    q, keys, values = q.cpu().float(), keys.cpu().float(), values.cpu().float()
    bs, out = keys.shape[1], []
    for i in range(q.shape[0]):
        n = int(lens[i])
        table = tables[int(seqs[i])].cpu().long()[: -(-n // bs)]
        k = keys[table].flatten(0, 1)[:n].transpose(0, 1)[None]  # [1, kv_heads, n, D]
        v = values[table].flatten(0, 1)[:n].transpose(0, 1)[None]
        mask = None
        if how.window is not None:
            mask = (torch.arange(n) >= n - how.window)[None, None, None, :]
        out.append(_attend(q[i][None, :, None], k, v, mask, False, how)[0, :, 0])
    return torch.stack(out)


def _check(dev, lens, how, splits=1, atol=2e-5, **shape):
    case = _case(dev, lens, **shape)
    got = paged_attention(*case, scale=how.scale, window=how.window, softcap=how.softcap,
                          sinks=None if how.sinks is None else how.sinks.to(dev),
                          splits=splits)
    assert got.dtype == case[0].dtype and got.shape == case[0].shape
    torch.testing.assert_close(got.cpu().float(), _oracle(*case, how), atol=atol, rtol=atol)


@pytest.mark.parametrize("lens", [[1], [4], [5, 13, 8], [17, 2]])
def test_decode_over_block_tables_matches_the_reference(dev, lens):
    _check(dev, lens, LayerAttention(16 ** -0.5))


@pytest.mark.parametrize("heads,kv_heads", [(8, 1), (6, 2), (3, 3)])
def test_gqa_groups_of_every_size_share_their_kv_head(dev, heads, kv_heads):
    _check(dev, [7, 11], LayerAttention(0.3), heads=heads, kv_heads=kv_heads)


def test_a_head_dim_and_block_size_not_powers_of_two_are_masked(dev):
    _check(dev, [9, 14], LayerAttention(0.2), dim=12, bs=3)


@pytest.mark.parametrize("window", [1, 3, 6, 40])
def test_a_sliding_window_sees_the_last_w_positions(dev, window):
    _check(dev, [5, 13, 22], LayerAttention(0.25, window=window))


def test_a_soft_cap_bounds_the_scores_before_the_softmax(dev):
    _check(dev, [6, 15], LayerAttention(1.0, softcap=2.0))


def test_sink_logits_join_each_softmax_denominator(dev):
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0])
    _check(dev, [1, 9, 14], LayerAttention(0.25, sinks=sinks))


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_kv_over_a_long_context_merges_to_the_same_output(dev, splits):
    # 8 splits of a 6-block context: some splits are empty and weigh nothing
    _check(dev, [23, 3], LayerAttention(0.25), splits=splits)


def test_splits_with_a_window_sinks_and_a_soft_cap_together(dev):
    how = LayerAttention(0.5, window=7, softcap=5.0, sinks=torch.tensor([1.0, -2.0, 0.0, 2.0]))
    _check(dev, [30, 8, 2], how, splits=4)


def test_bf16_queries_and_blocks_give_bf16_within_its_precision(dev):
    _check(dev, [10, 19], LayerAttention(0.25), dtype=torch.bfloat16, splits=2, atol=2e-2)


def test_prefill_queries_over_a_cached_prefix_see_prefix_plus_their_position(dev):
    # one sequence of 14 cached positions; queries 11..14 of a prefill segment share its table
    q, keys, values, tables, _, _ = _case(dev, [14])
    q = torch.randn(4, *q.shape[1:]).to(dev)
    seqs = torch.zeros(4, dtype=torch.int32, device=dev)
    lens = torch.arange(11, 15, dtype=torch.int32, device=dev)
    how = LayerAttention(0.25, window=5)
    got = paged_attention(q, keys, values, tables, seqs, lens, scale=0.25, window=5, splits=2)
    torch.testing.assert_close(got.cpu(), _oracle(q, keys, values, tables, seqs, lens, how),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("kind", ["int4", "int8", "fp8"])
def test_a_quantized_pool_with_a_residual_block_reads_as_its_decoded_blocks(dev, kind):
    """Sealed blocks decoded in the loop, the second sequence's last block from residual buffer
    1; split and windowed."""
    q, keys, values, tables, seqs, lens = _case("cpu", [15, 22], bs=4, dim=16)
    last = int(tables[1, 21 // 4])
    codecs = ((Fp8Codec(4, 2, 16),) * 2 if kind == "fp8" else
              (IntCodec(4, 2, 16, int(kind[3:]), "per-channel", 16),
               IntCodec(4, 2, 16, int(kind[3:]), "per-token", 8)))
    residual_of = torch.full((keys.shape[0],), -1, dtype=torch.int64)
    residual_of[last] = 1
    decoded, sides = [], []
    for codec, blocks in zip(codecs, (keys, values)):
        parts = codec.encode(blocks)
        residual = torch.randn(3, 4, 2, 16)
        plain = codec.decode(parts, torch.float32)
        plain[last] = residual[1]
        decoded.append(plain)
        numbers = codec_numbers(codec)
        sides.append(QuantizedSide(numbers.kind, numbers.bits, numbers.group,
                                   *(parts.get(f) if parts.get(f) is None else parts[f].to(dev)
                                     for f in ("codes", "scale", "zero")), residual.to(dev)))
    how = LayerAttention(0.25, window=9)
    got = paged_attention_quantized(q.to(dev), *sides, residual_of.to(dev), 4, tables.to(dev),
                                    seqs.to(dev), lens.to(dev), 0.25, window=9, splits=3)
    want = _oracle(q, decoded[0], decoded[1], tables, seqs, lens, how)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_the_split_count_fills_the_compute_units_without_short_splits():
    assert choose_splits(queries=1, kv_heads=8, blocks=512, units=132) == 33
    assert choose_splits(queries=64, kv_heads=8, blocks=512, units=132) == 1
    assert choose_splits(queries=1, kv_heads=1, blocks=6, units=132) == 1
    assert choose_splits(queries=1, kv_heads=1, blocks=4096, units=132) == 64
