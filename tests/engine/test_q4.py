"""Packed 4-bit GGUF weights: block decoding against the gguf library, kernel against dense."""

from __future__ import annotations

import numpy as np
import torch

from kvledger.engine.q4 import SMALL_BATCH, Linear, q4_parts


def test_q4_blocks_decode_like_the_gguf_library(bundled_path):
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(bundled_path))
    tensor = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    rows = int(tensor.shape[1])
    q, scale, zero = q4_parts(tensor.data, tensor.tensor_type.name, rows)
    ours = (q.astype(np.float32) - 8) * np.repeat(scale, 32, 1) + np.repeat(zero, 32, 1)
    theirs = dequantize(tensor.data, tensor.tensor_type).reshape(rows, -1)
    assert np.abs(ours - theirs).max() <= 1e-6


def test_packed_kernel_matches_dense_bf16_for_small_batches():
    gen = torch.Generator().manual_seed(0)
    out_f, in_f = 96, 128
    q = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    scale = torch.rand(out_f, in_f // 32, generator=gen) * 0.02
    zero = (torch.rand(out_f, in_f // 32, generator=gen) - 0.5) * 0.1
    dense = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    linear = Linear(dense.bfloat16(), None, (q, scale, zero))
    assert linear.packed is not None
    for rows in (1, SMALL_BATCH, SMALL_BATCH + 1):
        x = torch.randn(rows, in_f, generator=gen)
        ref = x @ dense.t()
        got = linear(x.bfloat16()).float()
        assert (got - ref).abs().max() <= 0.02 * ref.abs().max(), rows


def test_fp32_linear_never_packs():
    q = torch.zeros(32, 32, dtype=torch.uint8)
    s = torch.ones(32, 1)
    assert Linear(torch.zeros(32, 32), None, (q, s, s)).packed is None
