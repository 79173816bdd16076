"""The int8 / int4 / int2 KV codecs in Triton: full blocks to codes, fp16 scale and zero point
and back, the bytes of ``engine/kv/codecs.py``'s ``IntCodec`` exactly (taken as its numbers,
``engine/kv/codec_numbers.py``).

Encoding (one program per block and KV head): groups are a channel over the block's tokens
(``group`` 0, per-channel keys) or ``group`` consecutive channels of a token (per-token
values); ``scale = max((hi - lo) / (2^b - 1 + centred), min_scale)`` and ``zero = lo`` (centred:
``lo + scale / 2``), both rounded to fp16, and ``code = round((x - zero) / scale)`` clamped to
``[0, 2^b - 1]``, rounded half to even. The divisions are IEEE-rounded (``div_rn``, not the
GPU's approximate division) and the rounding adds and subtracts 1.5 x 2^23, so the bytes equal
PyTorch's on every device. Codes pack along head_dim, channel 0 in the lowest bits.

Decoding is ``code x scale + zero`` in fp32, then the compute dtype. Both kernels run without
FP fusion (``enable_fp_fusion=False``): a fused multiply-add would round once where PyTorch
rounds twice.

Shapes the kernels take: block size, head_dim and group powers of two (a Triton tile's sides);
:func:`accepts` says so, and the caller encodes other shapes with the codec's PyTorch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROUND = tl.constexpr(12582912.0)  # 1.5 x 2^23: x + ROUND - ROUND rounds fp32 |x| < 2^22 half to even
BITS = (8, 4, 2)


@triton.jit
def _pack(codes, BS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """uint8 codes [BS, D] -> bytes [BS, D * BITS // 8], channel 0 in the lowest bits."""
    if BITS == 4:
        low, high = tl.split(tl.reshape(codes, (BS, D // 2, 2)))
        codes = low | (high << 4)
    elif BITS == 2:  # channel 4i + 2a + b at bits 2(2a + b)
        even, odd = tl.split(tl.reshape(codes, (BS, D // 4, 2, 2)))
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        codes = c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)
    return codes


@triton.jit
def _unpack(packed, BS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Inverse of :func:`_pack`: bytes [BS, D * BITS // 8] -> codes [BS, D]."""
    if BITS == 4:
        packed = tl.reshape(tl.join(packed & 15, packed >> 4), (BS, D))
    elif BITS == 2:
        pairs = tl.join(tl.join(packed & 3, (packed >> 4) & 3),
                        tl.join((packed >> 2) & 3, packed >> 6))  # [BS, D/4, a, b]
        packed = tl.reshape(pairs, (BS, D))
    return packed


@triton.jit
def _levels(lo, hi, min_scale, QMAX: tl.constexpr, CENTRED: tl.constexpr):
    """fp16 (scale, zero) of groups spanning [lo, hi], as fp32."""
    scale = tl.maximum(tl.math.div_rn(hi - lo, QMAX + CENTRED), min_scale)
    scale = scale.to(tl.float16).to(tl.float32)
    zero = lo + scale * 0.5 if CENTRED else lo
    return scale, zero.to(tl.float16).to(tl.float32)


@triton.jit
def _encode_kernel(x_ptr, ids_ptr, codes_ptr, scale_ptr, zero_ptr, min_scale,
                   stride_xn, stride_xt, stride_xh,
                   H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                   GROUP: tl.constexpr, CENTRED: tl.constexpr):
    n, h = tl.program_id(0), tl.program_id(1)
    block = tl.load(ids_ptr + n).to(tl.int64)
    t, d = tl.arange(0, BS), tl.arange(0, D)
    x = tl.load(x_ptr + n * stride_xn + t[:, None] * stride_xt + h * stride_xh
                + d[None, :]).to(tl.float32)
    QMAX: tl.constexpr = (1 << BITS) - 1
    if GROUP == 0:  # a channel over the block's tokens: scale, zero [H, D]
        scale, zero = _levels(tl.min(x, axis=0), tl.max(x, axis=0), min_scale, QMAX, CENTRED)
        q = tl.math.div_rn(x - zero[None, :], scale[None, :])
        meta = (block * H + h) * D + d
        tl.store(scale_ptr + meta, scale.to(tl.float16))
        tl.store(zero_ptr + meta, zero.to(tl.float16))
    else:  # GROUP channels of a token: scale, zero [BS, H, D / GROUP]
        NG: tl.constexpr = D // GROUP
        xg = tl.reshape(x, (BS, NG, GROUP))
        scale, zero = _levels(tl.min(xg, axis=2), tl.max(xg, axis=2), min_scale, QMAX, CENTRED)
        q = tl.reshape(tl.math.div_rn(xg - zero[:, :, None], scale[:, :, None]), (BS, D))
        meta = ((block * BS + t[:, None]) * H + h) * NG + tl.arange(0, NG)[None, :]
        tl.store(scale_ptr + meta, scale.to(tl.float16))
        tl.store(zero_ptr + meta, zero.to(tl.float16))
    codes = tl.minimum(tl.maximum((q + ROUND) - ROUND, 0.0), QMAX).to(tl.uint8)
    W: tl.constexpr = D * BITS // 8
    at = ((block * BS + t[:, None]) * H + h) * W + tl.arange(0, W)[None, :]
    tl.store(codes_ptr + at, _pack(codes, BS, D, BITS))


@triton.jit
def dequant_block(codes_ptr, scale_ptr, zero_ptr, block, h, H: tl.constexpr, BS: tl.constexpr,
                  D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """KV head ``h`` of block ``block`` (int64) as fp32 [BS, D]: ``code x scale + zero``."""
    t, d = tl.arange(0, BS), tl.arange(0, D)
    W: tl.constexpr = D * BITS // 8
    packed = tl.load(codes_ptr + ((block * BS + t[:, None]) * H + h) * W
                     + tl.arange(0, W)[None, :])
    codes = _unpack(packed, BS, D, BITS).to(tl.float32)
    if GROUP == 0:
        meta = (block * H + h) * D + d
        x = (codes * tl.load(scale_ptr + meta).to(tl.float32)[None, :]
             + tl.load(zero_ptr + meta).to(tl.float32)[None, :])
    else:
        NG: tl.constexpr = D // GROUP
        meta = ((block * BS + t[:, None]) * H + h) * NG + tl.arange(0, NG)[None, :]
        scale = tl.load(scale_ptr + meta).to(tl.float32)
        zero = tl.load(zero_ptr + meta).to(tl.float32)
        x = tl.reshape(tl.reshape(codes, (BS, NG, GROUP)) * scale[:, :, None]
                       + zero[:, :, None], (BS, D))
    return x


@triton.jit
def _decode_kernel(codes_ptr, scale_ptr, zero_ptr, out_ptr,
                   H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                   GROUP: tl.constexpr):
    n, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    x = dequant_block(codes_ptr, scale_ptr, zero_ptr, n, h, H, BS, D, BITS, GROUP)
    at = ((n * BS + tl.arange(0, BS)[:, None]) * H + h) * D + tl.arange(0, D)[None, :]
    tl.store(out_ptr + at, x.to(out_ptr.dtype.element_ty))


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def accepts(block_size: int, head_dim: int, bits: int, group: int) -> bool:
    """Whether the kernels take this block shape and codec: powers of two, 8/4/2 bits."""
    return (bits in BITS and _pow2(block_size) and _pow2(head_dim) and head_dim >= 8 // bits * 2
            and (group == 0 or (_pow2(group) and group <= head_dim)))


def encode_into(blocks: torch.Tensor, parts: dict[str, torch.Tensor], block_ids: torch.Tensor,
                *, bits: int, group: int, centred: bool, min_scale: float) -> None:
    """Quantize ``blocks`` [n, bs, kv_heads, D] (last dim contiguous) and write codes, scale and
    zero at ``block_ids`` [n] of ``parts`` (contiguous ``IntCodec`` fields over all blocks)."""
    n, bs, heads, dim = blocks.shape
    assert blocks.stride(-1) == 1 and all(t.is_contiguous() for t in parts.values())
    _encode_kernel[(n, heads)](
        blocks, block_ids, parts["codes"], parts["scale"], parts["zero"], min_scale,
        blocks.stride(0), blocks.stride(1), blocks.stride(2),
        H=heads, BS=bs, D=dim, BITS=bits, GROUP=group, CENTRED=int(centred),
        enable_fp_fusion=False)


def decode(parts: dict[str, torch.Tensor], dtype: torch.dtype, *, bits: int,
           group: int) -> torch.Tensor:
    """Blocks [n, bs, kv_heads, D] in ``dtype`` from ``IntCodec`` fields ``[n, *shape]``."""
    codes = parts["codes"].contiguous()
    n, bs, heads, width = codes.shape
    dim = width * 8 // bits
    out = torch.empty(n, bs, heads, dim, dtype=dtype, device=codes.device)
    _decode_kernel[(n, heads)](codes, parts["scale"].contiguous(), parts["zero"].contiguous(),
                               out, H=heads, BS=bs, D=dim, BITS=bits, GROUP=group,
                               enable_fp_fusion=False)
    return out
