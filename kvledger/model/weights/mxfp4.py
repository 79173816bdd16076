"""MXFP4 expert weights of a gpt-oss checkpoint, dequantized at load.

OCP Microscaling (MX) formats v1.0, MXFP4: blocks of 32 FP4 (E2M1) values sharing one E8M0
scale, ``w = fp4 * 2^(scale - 127)``. gpt-oss stores each layer's experts as
``mlp.experts.{gate_up,down}_proj_blocks`` uint8 [experts, out, in / 32, 16] (two E2M1 codes a
byte, the low nibble first) and ``*_scales`` uint8 [experts, out, in / 32]; they are decoded here
into the bf16 checkpoint's ``gate_up_proj`` / ``down_proj`` [experts, in, out] (transformers'
``integrations.mxfp4.convert_moe_packed_tensors``), which :mod:`.names` splits per expert. The
engine then holds them in the format the device chose for the ``gate_up`` / ``down`` classes:
no MXFP4 kernel, the bytes read per token are those of that format.
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 FP4 (E2M1) values by code: sign bit 3, exponent bits 2-1, mantissa bit 0."""
SCALE_BIAS = 127
"""The E8M0 scale's exponent bias."""


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP32 [..., groups * 32] of MXFP4 ``blocks`` uint8 [..., groups, 16] and ``scales`` uint8
    [..., groups] (module docstring).

    Raises:
        ValueError: shapes that do not pair (a block of 16 bytes per scale).
    """
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} "
                         "do not pair (16 bytes per block, one scale per block)")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = blocks.to(torch.int64)
    values = torch.stack((lut[codes & 0x0F], lut[codes >> 4]), dim=-1).flatten(-2)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None]).flatten(-2)


def dequantize_experts(state: dict, experts: str) -> None:
    """Replace ``{experts}{gate_up,down}_proj_blocks`` / ``_scales`` in ``state`` by the bf16
    checkpoint's ``{experts}{gate_up,down}_proj`` [experts, in, out], in bf16 (which holds
    every MXFP4 value exactly), one expert at a time (no fp32 copy of a whole layer); nothing
    when the layer holds none."""
    for proj in ("gate_up_proj", "down_proj"):
        blocks = state.pop(f"{experts}{proj}_blocks", None)
        if blocks is not None:
            scales = state.pop(f"{experts}{proj}_scales")
            out = torch.empty(*blocks.shape[:2], blocks.shape[2] * 32, dtype=torch.bfloat16)
            for e in range(len(blocks)):
                out[e] = dequantize(blocks[e], scales[e])
            state[experts + proj] = out.transpose(1, 2)
