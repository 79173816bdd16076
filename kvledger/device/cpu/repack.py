"""The ``w8a8`` and ``w4a8`` weights repacked at load for the decode products to stream them
(``interleaved_gemv.h``).

A weight in blocks of 32 inputs, its code bytes ``codes`` [out, blocks, n] (``w8a8``: the int8
codes, n = 32, GGML's Q8_0 layout; ``w4a8``: the GGUF Q4_0 / Q4_1 file's 16 bytes per block, byte
j holding code j in its low nibble and code j + 16 in its high one, :func:`kvledger.model.q4.
q4_blocks`) and fp32 per-block numbers ``floats`` [out, blocks] (``w8a8``: the scale; ``w4a8``:
the scale e and the minimum m, ``w = e * code + m``), is rewritten as one uint8 tensor
[ceil(out / 8), blocks, 8 n + 32 k] for k floats: the output rows in groups of :data:`ROWS` (the
last padded with zero rows), one record per group and block:

- bytes ``32 c + 4 t .. 32 c + 4 t + 3``: row t's code bytes ``4 c .. 4 c + 3`` of the block,
- then each float of the 8 rows in turn (fp32).

The kernel then reads a weight as one sequential stream, and a 32-byte load holds 4 code bytes of
each of 8 rows, which one dot-product instruction turns into 8 row sums (the layout of
ik_llama.cpp's run-time repacked ``_R8`` rows, with the scales inline). The bytes held are the
same as the parts' (plus the padding rows). :func:`unpack` gives the parts back (all rows or
some: the rows of a tied embedding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS = 8
"""Output rows per group."""


def repack(codes: torch.Tensor, *floats: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(out / 8), blocks, 8 n + 32 len(floats)] of ``codes`` (uint8 or int8
    [out, blocks, n], n a multiple of 4) and ``floats`` (fp32 [out, blocks] each)."""
    out, blocks, n = codes.shape
    pad = -out % ROWS
    groups = (out + pad) // ROWS
    codes = F.pad(codes.view(torch.uint8), (0, 0, 0, 0, 0, pad))
    codes = codes.reshape(groups, ROWS, blocks, n // 4, 4).permute(0, 2, 3, 1, 4)
    scales = F.pad(torch.stack(floats), (0, 0, 0, pad)).reshape(len(floats), groups, ROWS, blocks)
    scales = scales.permute(1, 3, 0, 2).contiguous().view(torch.uint8)
    return torch.cat([codes.reshape(groups, blocks, -1), scales.reshape(groups, blocks, -1)],
                     dim=-1).contiguous()


def unpack(packed: torch.Tensor, ids: torch.Tensor, n: int
           ) -> tuple[torch.Tensor, ...]:
    """The code bytes uint8 [T, blocks, n] and each float [T, blocks] of rows ``ids`` [T] (int64)
    of a :func:`repack` ed weight with ``n`` code bytes per row and block (only those rows'
    groups are read)."""
    blocks = packed.shape[1]
    records = packed[ids // ROWS]                                      # [T, blocks, record]
    pick = torch.arange(len(ids)), slice(None), slice(None), ids % ROWS
    codes = records[..., :ROWS * n].reshape(len(ids), blocks, n // 4, ROWS, 4)[pick]
    k = (packed.shape[2] - ROWS * n) // (4 * ROWS)
    floats = records[..., ROWS * n:].contiguous().view(torch.float32)
    floats = floats.reshape(len(ids), blocks, k, ROWS)[pick]           # [T, blocks, k]
    return (codes.reshape(len(ids), blocks, n).contiguous(),
            *(floats[..., i].contiguous() for i in range(k)))
