"""The fp8 (e4m3) KV codec in Triton: the bytes of ``engine/kv/codecs.py``'s ``Fp8Codec``.

One program per block and KV head: ``scale = max(amax / 448, min_scale)`` over the block's
tokens and channels (fp32), ``code = e4m3(clamp(x / scale, +-448))`` stored as its byte (the
division IEEE-rounded; rounded to nearest even onto e4m3's values in fp32 before the cast, so
the cast is exact whatever converter runs it: the interpreter's loses a rounding's carry into
the exponent). Decoding is
``code x scale`` in fp32, then the compute dtype. Block size and head_dim: powers of two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3fn (codecs.FP8_MAX)
ROUND = tl.constexpr(12582912.0)  # 1.5 x 2^23: x + ROUND - ROUND rounds half to even


@triton.jit
def _to_e4m3_grid(y):
    """fp32 ``y`` (|y| <= 448) rounded half to even onto e4m3's values: 3 mantissa bits at
    y's exponent, the step 2^-9 below the least normal 2^-6 (the division by a power of two
    exact)."""
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    grid = ((tl.math.div_rn(y, step) + ROUND) - ROUND) * step
    return tl.where(grid == 0.0, y * 0.0, grid)  # a negative y rounds to -0, as the cast




@triton.jit
def _encode_kernel(x_ptr, ids_ptr, codes_ptr, scale_ptr, min_scale,
                   stride_xn, stride_xt, stride_xh,
                   H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr):
    n, h = tl.program_id(0), tl.program_id(1)
    block = tl.load(ids_ptr + n).to(tl.int64)
    t, d = tl.arange(0, BS), tl.arange(0, D)
    x = tl.load(x_ptr + n * stride_xn + t[:, None] * stride_xt + h * stride_xh
                + d[None, :]).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), min_scale)
    scaled = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
    codes = _to_e4m3_grid(scaled).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(codes_ptr + ((block * BS + t[:, None]) * H + h) * D + d[None, :], codes)
    tl.store(scale_ptr + block * H + h, scale)


@triton.jit
def dequant_block(codes_ptr, scale_ptr, block, h, H: tl.constexpr, BS: tl.constexpr,
                  D: tl.constexpr):
    """KV head ``h`` of block ``block`` (int64) as fp32 [BS, D]: ``code x scale``."""
    at = ((block * BS + tl.arange(0, BS)[:, None]) * H + h) * D + tl.arange(0, D)[None, :]
    codes = tl.load(codes_ptr + at).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return codes * tl.load(scale_ptr + block * H + h)


@triton.jit
def _decode_kernel(codes_ptr, scale_ptr, out_ptr,
                   H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr):
    n, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    x = dequant_block(codes_ptr, scale_ptr, n, h, H, BS, D)
    at = ((n * BS + tl.arange(0, BS)[:, None]) * H + h) * D + tl.arange(0, D)[None, :]
    tl.store(out_ptr + at, x.to(out_ptr.dtype.element_ty))


def encode_into(blocks: torch.Tensor, parts: dict[str, torch.Tensor], block_ids: torch.Tensor,
                *, min_scale: float) -> None:
    """Encode ``blocks`` [n, bs, kv_heads, D] (last dim contiguous) and write codes and scale
    at ``block_ids`` [n] of ``parts`` (contiguous ``Fp8Codec`` fields over all blocks)."""
    n, bs, heads, dim = blocks.shape
    assert blocks.stride(-1) == 1 and all(t.is_contiguous() for t in parts.values())
    _encode_kernel[(n, heads)](blocks, block_ids, parts["codes"], parts["scale"], min_scale,
                               blocks.stride(0), blocks.stride(1), blocks.stride(2),
                               H=heads, BS=bs, D=dim, enable_fp_fusion=False)


def decode(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Blocks [n, bs, kv_heads, D] in ``dtype`` from ``Fp8Codec`` fields ``[n, *shape]``."""
    codes = parts["codes"].contiguous()
    n, bs, heads, dim = codes.shape
    out = torch.empty(n, bs, heads, dim, dtype=dtype, device=codes.device)
    _decode_kernel[(n, heads)](codes, parts["scale"].contiguous(), out, H=heads, BS=bs, D=dim,
                               enable_fp_fusion=False)
    return out
