"""Paged attention in Triton: each query over the first ``context_lens[i]`` positions of its
sequence's blocks (the block-table form of ``PagedQueries``), read in place from the pool.

One program takes one query, one KV head and one *split* (a run of the context's blocks): the
KV head's GQA group of query heads shares each K/V block it loads, and an online softmax (a
running maximum m, normaliser l and weighted sum acc per query head; Milakov & Gimelshein,
arXiv:1805.02867) walks the split's blocks. A second kernel merges the splits (flash-decoding:
a long context is read by many programs at once) and adds the sink logits once:
``out = sum_s acc_s e^(m_s - M) / (sum_s l_s e^(m_s - M) + e^(sink - M))`` with M the largest
of the m_s and the sink.

Per layer, as ``engine/attention/layer.py`` describes: the score scale, a sliding window (the
query at position ``context_len - 1`` sees the last W positions), a soft-cap
(``c tanh(s / c)``) and sink logits [heads]. Because a query's context is its own length, one
launch serves decode (one query per sequence) and prefill over a cached prefix (query j of a
segment sees ``prefix + j + 1`` positions) alike.

A quantized pool (:func:`paged_attention_quantized`: int8 / int4 / int2 or fp8, both sides one
kind) is read block by block with the codecs' own dequantization (``kv_int.dequant_block``,
``kv_fp8.dequant_block``); a block whose ``residual_of`` slot is >= 0 (not sealed yet) comes
from that full-precision residual buffer instead.

The split count is a runtime argument (one compiled kernel for every count; the merge compiles
per power of two). The products are broadcast multiply-and-sum, not ``tl.dot``: a decode's GQA
group is far below the 16 rows a tensor-core tile needs, and the kernel stays bound by reading
K/V. Not yet tuned on a GPU (``num_warps``, tile sizes): the [group, block, head_dim] product
is held in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvledger.device.cuda.triton_kernels import kv_fp8, kv_int


@triton.jit
def _tanh(x):
    """tanh from exp (no libdevice call, so the interpreter and every GPU run the same)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _kv_tile(plain_ptr, codes_ptr, scale_ptr, zero_ptr, residual_ptr, slot, block, h, tile,
             stride_kb, stride_kt, stride_kh, H: tl.constexpr, D: tl.constexpr,
             DP: tl.constexpr, BS: tl.constexpr, BSP: tl.constexpr, KIND: tl.constexpr,
             BITS: tl.constexpr, GROUP: tl.constexpr):
    """KV head ``h`` of block ``block`` as fp32 [BSP, DP]: read in place (KIND 0), or a
    quantized block (1: int, 2: fp8) decoded, or its residual buffer ``slot`` (>= 0) while it
    is unsealed (quantized blocks: BS and D powers of two)."""
    t, d = tl.arange(0, BSP), tl.arange(0, DP)
    if KIND == 0:
        x = tl.load(plain_ptr + block * stride_kb + t[:, None] * stride_kt + h * stride_kh
                    + d[None, :], mask=tile, other=0.0).to(tl.float32)
    elif slot >= 0:
        x = tl.load(residual_ptr + ((slot * BS + t[:, None]) * H + h) * D
                    + d[None, :]).to(tl.float32)
    elif KIND == 1:
        x = kv_int.dequant_block(codes_ptr, scale_ptr, zero_ptr, block, h, H, BS, D, BITS, GROUP)
    else:
        x = kv_fp8.dequant_block(codes_ptr, scale_ptr, block, h, H, BS, D)
    return x


@triton.jit
def _split_kernel(q_ptr, k_ptr, k_codes, k_scale, k_zero, k_res,
                  v_ptr, v_codes, v_scale, v_zero, v_res, residual_of,
                  tables_ptr, seq_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr,
                  scale, softcap, window, blocks_per_split, splits,
                  stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_tab,
                  HEADS: tl.constexpr, H: tl.constexpr, GP: tl.constexpr,
                  D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BSP: tl.constexpr,
                  SOFTCAP: tl.constexpr, KIND: tl.constexpr, K_BITS: tl.constexpr,
                  K_GROUP: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr):
    i, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    GROUP: tl.constexpr = HEADS // H
    seq = tl.load(seq_ptr + i).to(tl.int64)
    ctx = tl.load(lens_ptr + i)
    start = tl.maximum(ctx - window, 0) if window > 0 else 0
    g, d, t = tl.arange(0, GP), tl.arange(0, DP), tl.arange(0, BSP)
    gm, dm = g < GROUP, d < D
    heads = h * GROUP + g
    q = tl.load(q_ptr + i * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=gm[:, None] & dm[None, :], other=0.0).to(tl.float32) * scale
    lo = tl.maximum(s * blocks_per_split, start // BS)
    hi = tl.minimum((s + 1) * blocks_per_split, (ctx + BS - 1) // BS)
    m = tl.full((GP,), float("-inf"), tl.float32)
    l_sum = tl.zeros((GP,), tl.float32)
    acc = tl.zeros((GP, DP), tl.float32)
    for b in range(lo, hi):
        block = tl.load(tables_ptr + seq * stride_tab + b).to(tl.int64)
        slot = tl.load(residual_of + block) if KIND != 0 else -1
        pos = b * BS + t
        seen = (t < BS) & (pos < ctx) & (pos >= start)
        tile = seen[:, None] & dm[None, :]
        k = _kv_tile(k_ptr, k_codes, k_scale, k_zero, k_res, slot, block, h, tile,
                     stride_kb, stride_kt, stride_kh, H, D, DP, BS, BSP, KIND, K_BITS, K_GROUP)
        v = _kv_tile(v_ptr, v_codes, v_scale, v_zero, v_res, slot, block, h, tile,
                     stride_kb, stride_kt, stride_kh, H, D, DP, BS, BSP, KIND, V_BITS, V_GROUP)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GP, BSP]
        if SOFTCAP:
            scores = _tanh(scores / softcap) * softcap
        scores = tl.where(seen[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet
        corr = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_sum = l_sum * corr + tl.sum(p, axis=1)
        acc = acc * corr[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    row = (i * HEADS + heads) * splits + s
    tl.store(m_ptr + row, m, mask=gm)
    tl.store(l_ptr + row, l_sum, mask=gm)
    tl.store(acc_ptr + row[:, None] * DP + d[None, :], acc, mask=gm[:, None])


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, sinks_ptr, out_ptr, stride_on, stride_oh, splits,
                  HEADS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  SP: tl.constexpr, HAS_SINKS: tl.constexpr):
    i, head = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, SP), tl.arange(0, DP)
    row = (i * HEADS + head) * splits + s
    m = tl.load(m_ptr + row, mask=s < splits, other=float("-inf"))
    l_sum = tl.load(l_ptr + row, mask=s < splits, other=0.0)
    acc = tl.load(acc_ptr + row[:, None] * DP + d[None, :], mask=(s < splits)[:, None],
                  other=0.0)
    top = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(top, sink)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))  # an empty split weighs 0
    den = tl.sum(weight * l_sum, axis=0)
    if HAS_SINKS:
        den += tl.exp(sink - top)
    out = tl.sum(weight[:, None] * acc, axis=0) / den
    tl.store(out_ptr + i * stride_on + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < D)


def choose_splits(queries: int, kv_heads: int, blocks: int, units: int) -> int:
    """Splits per (query, KV head): enough programs for two per compute unit, no split
    shorter than 4 blocks, at most 64."""
    programs = queries * kv_heads
    wanted = -(-2 * units // programs) if programs < 2 * units else 1
    return max(1, min(wanted, blocks // 4, 64))


@dataclass(frozen=True)
class QuantizedSide:
    """One side (K or V) of a quantized pool as the kernel reads it: the codec's numbers
    (``kind`` ``"int"`` or ``"fp8"``, ``bits``, ``group``: 0 per channel), its fields over all
    blocks (``codes``, ``scale``, ``zero``: None for fp8; contiguous), the residual buffers
    [slots, block_size, kv_heads, D] of unsealed blocks, and the fp32 rotation [D, D] the rows
    are stored by (None: none; the caller turns queries and output)."""

    kind: str
    bits: int
    group: int
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    residual: torch.Tensor
    rotation: torch.Tensor | None = None
    num_outliers = 0  # outlier channels are not read here (the engine checks V has none)


def paged_attention(q: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
                    block_tables: torch.Tensor, seq_of_query: torch.Tensor,
                    context_lens: torch.Tensor, scale: float, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    splits: int = 1) -> torch.Tensor:
    """Output [N, heads, D] (q's dtype) of queries q [N, heads, D] over K/V blocks
    [blocks, block_size, kv_heads, D] (last dim contiguous): query i sees the first
    ``context_lens[i]`` (>= 1) positions of the sequence whose blocks are
    ``block_tables[seq_of_query[i]]``, the last ``window`` of them when given; scores times
    ``scale``, soft-capped at ``softcap`` when given, sink logits ``sinks`` [heads] when given;
    the context read in ``splits`` runs of blocks at once."""
    assert key_blocks.stride() == value_blocks.stride() and key_blocks.stride(-1) == 1
    plain = (key_blocks, None, None, None, None, value_blocks, None, None, None, None, None)
    return _launch(q, plain, key_blocks.shape[1], key_blocks.shape[2], key_blocks.stride()[:3],
                   (0, 0, 0, 0, 0), block_tables, seq_of_query, context_lens, scale, window,
                   softcap, sinks, splits)


def paged_attention_quantized(q: torch.Tensor, keys: QuantizedSide, values: QuantizedSide,
                              residual_of: torch.Tensor, block_size: int,
                              block_tables: torch.Tensor, seq_of_query: torch.Tensor,
                              context_lens: torch.Tensor, scale: float,
                              window: int | None = None, softcap: float | None = None,
                              sinks: torch.Tensor | None = None,
                              splits: int = 1) -> torch.Tensor:
    """:func:`paged_attention` over a quantized pool: sealed blocks decoded from ``keys`` /
    ``values`` (one kind for both), block b from residual buffer ``residual_of[b]`` (int64)
    while that is >= 0. Block size and head_dim: powers of two."""
    kind = 2 if keys.kind == "fp8" else 1
    assert values.kind == keys.kind
    sides = (None, keys.codes, keys.scale, keys.zero, keys.residual,
             None, values.codes, values.scale, values.zero, values.residual, residual_of)
    return _launch(q, sides, block_size, keys.residual.shape[2], (0, 0, 0),
                   (kind, keys.bits, keys.group, values.bits, values.group), block_tables,
                   seq_of_query, context_lens, scale, window, softcap, sinks, splits)


def _launch(q, sides, block_size, kv_heads, strides, codec, block_tables, seq_of_query,
            context_lens, scale, window, softcap, sinks, splits) -> torch.Tensor:
    n, heads, dim = q.shape
    q = q.contiguous()
    sinks = None if sinks is None else sinks.float().contiguous()
    used = -(-int(context_lens.max()) // block_size)
    per_split = -(-used // splits)
    dp = triton.next_power_of_2(dim)
    m = torch.empty(n * heads * splits, dtype=torch.float32, device=q.device)
    l_sum, acc = torch.empty_like(m), torch.empty(n * heads * splits * dp, dtype=torch.float32,
                                                   device=q.device)
    sides = tuple(m if t is None else t for t in sides)  # an unused pointer: any tensor
    kind, k_bits, k_group, v_bits, v_group = codec
    _split_kernel[(n, kv_heads, splits)](
        q, *sides, block_tables, seq_of_query, context_lens, m, l_sum, acc,
        scale, softcap or 0.0, window or 0, per_split, splits,
        q.stride(0), q.stride(1), *strides, block_tables.stride(0),
        HEADS=heads, H=kv_heads, GP=triton.next_power_of_2(heads // kv_heads), D=dim, DP=dp,
        BS=block_size, BSP=triton.next_power_of_2(block_size), SOFTCAP=softcap is not None,
        KIND=kind, K_BITS=k_bits, K_GROUP=k_group, V_BITS=v_bits, V_GROUP=v_group,
        enable_fp_fusion=True)
    out = torch.empty_like(q)
    _merge_kernel[(n, heads)](
        m, l_sum, acc, sinks if sinks is not None else m, out, out.stride(0), out.stride(1),
        splits, HEADS=heads, D=dim, DP=dp, SP=triton.next_power_of_2(splits),
        HAS_SINKS=sinks is not None, enable_fp_fusion=True)
    return out
