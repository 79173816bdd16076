"""The ``w4a8`` weight repacked at load for the decode product to stream it (``w4a8_gemv.h``).

A GGUF Q4_0 / Q4_1 weight in the file's block form (:func:`kvledger.model.q4.q4_blocks`: codes
``qs`` uint8 [out, in / 2], per block of 32 inputs byte j holding code j in its low nibble and
code j + 16 in its high one; fp32 scales ``e`` and minima ``m`` [out, in / 32], ``w = e * code +
m``) is rewritten as one uint8 tensor [ceil(out / 8), in / 32, 192]: the output rows in groups
of :data:`ROWS` (the last padded with zero rows), one 192-byte record per group and block:

- bytes ``32 k + 4 t .. 32 k + 4 t + 3``: row t's bytes ``4 k .. 4 k + 3`` of the block (k = 0..3),
- bytes 128-159: the 8 rows' ``e``, 160-191: their ``m`` (fp32).

The kernel then reads a weight as one sequential stream, and a 32-byte load holds 4 codes of each
of 8 rows, which one dot-product instruction turns into 8 row sums (the layout of
ik_llama.cpp's run-time repacked ``Q4_0_R8`` rows, with the scales inline). The bytes held are
the same as the three tensors' (plus the padding rows). :func:`unpack` gives the file form back
(all rows or some: the rows of a tied embedding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32
ROWS = 8
"""Output rows per group."""
RECORD = ROWS * BLOCK // 2 + 2 * ROWS * 4
"""Bytes per group and block: 128 of codes, 32 of scales, 32 of minima."""


def repack(qs: torch.Tensor, e: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(out / 8), in / 32, :data:`RECORD`] of the file-form parts (the module
    docstring); the parts as :meth:`kvledger.device.cpu.w8a8.W8A8Kernel.bind_q4` checks them."""
    out, blocks = e.shape
    pad = -out % ROWS
    groups = (out + pad) // ROWS
    qs, e, m = (F.pad(t, (0, 0, 0, pad)) for t in (qs, e, m))
    codes = qs.reshape(groups, ROWS, blocks, 4, 4).permute(0, 2, 3, 1, 4)
    scales = torch.stack([e, m]).reshape(2, groups, ROWS, blocks).permute(1, 3, 0, 2)
    return torch.cat([codes.reshape(groups, blocks, -1),
                      scales.contiguous().view(torch.uint8).reshape(groups, blocks, -1)],
                     dim=-1).contiguous()


def unpack(packed: torch.Tensor, ids: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The file-form ``qs`` [T, in / 2], ``e`` and ``m`` [T, in / 32] of rows ``ids`` [T] (int64)
    of a :func:`repack` ed weight (only those rows' groups are read)."""
    blocks = packed.shape[1]
    records = packed[ids // ROWS]                                     # [T, blocks, RECORD]
    pick = torch.arange(len(ids)), slice(None), slice(None), ids % ROWS
    codes = records[..., :ROWS * BLOCK // 2].reshape(-1, blocks, 4, ROWS, 4)[pick]
    scales = records[..., ROWS * BLOCK // 2:].contiguous().view(torch.float32)
    scales = scales.reshape(-1, blocks, 2, ROWS)[pick]                # [T, blocks, 2]
    return (codes.reshape(len(ids), -1).contiguous(), scales[..., 0].contiguous(),
            scales[..., 1].contiguous())
