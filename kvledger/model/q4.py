"""4-bit GGUF weights: the codes, scales and zeros of Q4_0 / Q4_1 blocks.

A GGUF Q4_0 / Q4_1 block stores 32 weights as 4-bit codes q in [0, 15] with an fp16 scale d
(and for Q4_1 an fp16 minimum m): ``w = d * (q - 8)`` (Q4_0) or ``w = d * q + m`` (Q4_1)
(ggml's ``block_q4_0`` / ``block_q4_1``; code j of a block is the low nibble of byte j, code
j + 16 the high nibble). Both are ``w = (q - 8) * scale + zero`` with ``scale = d`` and
``zero = 0`` or ``m + 8 d``, the form PyTorch's CPU int4 weight-only kernel
(``aten._weight_int4pack_mm_for_cpu``, group size 32) computes with.

The packed form is one of the weight formats of :class:`kvledger.model.linear.Linear`.
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32
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


def q4_blocks(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Q4 parts of :func:`q4_parts` back in the file's block form, for the ``w4a8`` kernel.

    Args:
        q: uint8 [out, in] codes in [0, 15]; scale, zero: [out, in / 32] (``w = (q - 8) * scale
            + zero``).
    Returns:
        qs uint8 [out, in / 2] (per block of 32, byte j holds code j in its low nibble and code
        j + 16 in its high one: ggml's order), e = scale and m = zero - 8 * scale, fp32
        [out, in / 32] (``w = e * q + m``).
    """
    out, width = q.shape
    blocks = q.reshape(out, width // GROUP, 2, GROUP // 2).to(torch.uint8)
    qs = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, width // 2)
    e = scale.to(torch.float32).contiguous()
    return qs.contiguous(), e, (zero.to(torch.float32) - 8 * e).contiguous()


def q4_dequantize(qs: torch.Tensor, e: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] weight of the :func:`q4_blocks` form (``w = e * q + m``)."""
    blocks = qs.view(qs.shape[0], -1, GROUP // 2)
    codes = torch.cat([blocks & 0x0F, blocks >> 4], dim=-1)  # [out, in / 32, 32]
    return (codes.float() * e[..., None] + m[..., None]).reshape(qs.shape[0], -1)
