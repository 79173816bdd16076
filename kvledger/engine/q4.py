"""4-bit GGUF weights kept packed for small-batch matmuls (the decode hot path).

A GGUF Q4_0 / Q4_1 block stores 32 weights as 4-bit codes q in [0, 15] with an fp16 scale d
(and for Q4_1 an fp16 minimum m): ``w = d * (q - 8)`` (Q4_0) or ``w = d * q + m`` (Q4_1)
(ggml's ``block_q4_0`` / ``block_q4_1``; code j of a block is the low nibble of byte j, code
j + 16 the high nibble). Both are ``w = (q - 8) * scale + zero`` with ``scale = d`` and
``zero = 0`` or ``m + 8 d``, the form PyTorch's CPU int4 weight-only kernel
(``aten._weight_int4pack_mm_for_cpu``, group size 32) computes with.

Decoding one token reads every weight once, so at batch 1 it is memory-bound: the packed
weights are 1/4 of bf16's bytes. The kernel does not reuse weights across rows, so a
:class:`Linear` uses it only up to ``SMALL_BATCH`` rows and the dense bf16 matrix beyond
(prefill, large decode batches). The kernel runs with bf16 activations, scales and zeros: the
scales lose the fp16 mantissa's last 3 bits, an error of the same order as bf16 weights.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

GROUP = 32
SMALL_BATCH = 8
Q4_TYPES = {"Q4_0": 18, "Q4_1": 20}  # bytes per block of 32 weights


def q4_parts(data: np.ndarray, type_name: str, rows: int) -> tuple[np.ndarray, ...]:
    """Codes, scales and zeros of a raw Q4_0/Q4_1 tensor.

    Args:
        data: the tensor's raw blocks (uint8, any shape; ``rows`` x cols / 32 blocks).
        type_name: ``"Q4_0"`` or ``"Q4_1"``.
    Returns:
        q uint8 [rows, cols], scale float32 [rows, cols / 32], zero float32 [rows, cols / 32]
        with ``w = (q - 8) * scale + zero`` per group of 32 columns.
    """
    blocks = data.reshape(-1, Q4_TYPES[type_name])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    if type_name == "Q4_1":
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
        zero = m + 8 * d
    else:
        zero = np.zeros_like(d)
    qs = blocks[:, -16:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # [blocks, 32]
    return q.reshape(rows, -1), d.reshape(rows, -1), zero.reshape(rows, -1)


class Linear:
    """``y = x @ W.T`` with an optional packed 4-bit copy of W for small batches.

    Args:
        weight: dense [out, in] matrix (the model dtype).
        bias: optional [out].
        q4: optional (q uint8 [out, in], scale [out, in/32], zero [out, in/32]) of the same W;
            used when activations are bf16 and a call has at most SMALL_BATCH rows.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 q4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.packed = self.scales_zeros = None
        if q4 is not None and weight.dtype == torch.bfloat16:
            q, scale, zero = q4
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.to(torch.int32).contiguous(), 1)
            self.scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(
                torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, in] -> [tokens, out]."""
        if self.packed is None or x.shape[0] > SMALL_BATCH:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scales_zeros)
        return y if self.bias is None else y + self.bias
