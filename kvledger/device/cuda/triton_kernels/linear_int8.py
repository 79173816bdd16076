"""The int8 weight-only product in Triton: ``y = (x @ q^T) x s`` for activations x [M, K]
(bf16 / fp16 / fp32), a weight's symmetric per-row int8 codes q [N, K] and their scales s [N]
(``kvledger.model.linear``'s ``int8`` format: ``w = q x s_row``).

One program per tile of BLOCK_M rows and BLOCK_N outputs: each step along K loads a tile of x
and of the codes and accumulates their ``tl.dot`` in fp32 (both operands in fp32: bf16
activations and int8 codes are exact in the TF32 a GPU's fp32 dot rounds to, and the
interpreter's bf16 dot is wrong); the scales multiply the sums once, and the result is rounded
to x's dtype.
The weight is read once as int8, half the bytes of bf16: what a decode step (few rows) is
bound by. Rows are padded to the tile (16: ``tl.dot``'s least).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_ym,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        q = tl.load(q_ptr + cols[None, :] * stride_qn + k[:, None],
                    mask=(cols[None, :] < N) & (k[:, None] < K), other=0)
        acc += tl.dot(x.to(tl.float32), q.to(tl.float32))
    scale = tl.load(s_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = (acc * scale[None, :]).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y,
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[M, K] x's dtype times int8 codes [N, K] with row scales [N] -> [M, N] in x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _kernel[grid](x, codes, scales, y, m, n, k, x.stride(0), codes.stride(0), y.stride(0),
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return y
