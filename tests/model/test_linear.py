"""Weight formats: Q4 blocks against the gguf library, each packed kernel against dense."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvledger.device.cpu.kernels import KERNELS
from kvledger.model.linear import Linear, int8_rows
from kvledger.model.q4 import q4_parts


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


def _q4_matrix(out_f=96, in_f=128):
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    scale = torch.rand(out_f, in_f // 32, generator=gen) * 0.02
    zero = (torch.rand(out_f, in_f // 32, generator=gen) - 0.5) * 0.1
    dense = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    return dense, (q, scale, zero)


@pytest.mark.parametrize("fmt", ["int4", "w4a8", "int8", "dense"])
@pytest.mark.parametrize("rows", [1, 8, 33])
def test_each_format_matches_the_fp32_product(fmt, rows):
    dense, q4 = _q4_matrix()
    linear = Linear(dense.bfloat16(), None, q4, fmt, kernels=KERNELS)
    assert linear.format == fmt
    assert (linear.weight is None) == (fmt != "dense")  # one copy only
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows))
    ref = x @ dense.t()
    got = linear(x.bfloat16()).float()
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()


def test_int8_rows_round_within_half_a_step():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(2))
    codes, scale = int8_rows(w)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    assert ((codes.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("block", [None, 32])
def test_int8_rows_release_each_chunk_once_after_reading_it(block):
    """Each released chunk is poisoned (as pages handed back would be re-read, or lost): the
    codes must not change, and the released rows must tile the matrix exactly once."""
    w = torch.randn(70, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = int8_rows(w.clone(), chunk_rows=16, block=block)
    seen = torch.zeros(70, dtype=torch.int64)

    def release(chunk):
        first = (chunk.data_ptr() - w.data_ptr()) // (w.stride(0) * w.element_size())
        seen[first:first + chunk.shape[0]] += 1
        chunk.fill_(float("nan"))

    got = int8_rows(w, chunk_rows=16, block=block, release=release)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert seen.tolist() == [1] * 70


def test_int8_rows_lookup_is_the_dequantized_row():
    w = torch.randn(50, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    linear = Linear(w, fmt="int8", kernels=KERNELS)
    ids = torch.tensor([4, 0, 49])
    want = linear.packed[ids].float() * linear.scales[ids, None].float()
    assert torch.allclose(linear.rows(ids, torch.float32), want, rtol=1e-2)
    assert (linear.rows(ids, torch.float32) - w[ids].float()).abs().max() <= 0.02


def test_fp32_weights_stay_dense_and_int4_needs_q4():
    dense, q4 = _q4_matrix()
    assert Linear(dense, None, q4, "int4", kernels=KERNELS).format == "dense"
    assert Linear(dense.bfloat16(), None, None, "int4", kernels=KERNELS).format == "dense"
    with pytest.raises(ValueError, match="format"):
        Linear(dense, fmt="fp8", kernels=KERNELS)


def test_int4_on_a_shape_the_kernel_refuses_stays_dense():
    # torch's CPU int4 packing raises for out_features not a multiple of 16 (tiny models)
    dense, q4 = _q4_matrix(out_f=24, in_f=64)
    linear = Linear(dense.bfloat16(), None, q4, "int4", kernels=KERNELS)
    assert linear.format == "dense"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(linear(x.bfloat16()).float(), x @ dense.t(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("fmt", ["int8", "w8a8"])
def test_int8_on_a_width_the_kernel_refuses_gives_the_product(fmt):
    # torch 2.13's _weight_int8pack_mm crashed the process on input widths that are not a
    # multiple of 16 (an AVX-512 CPU; a tiny tensor-parallel shard had 40): the product of
    # such a layer must still come out right, with or without that kernel
    w = torch.randn(64, 40, generator=torch.Generator().manual_seed(5))
    linear = Linear(w.bfloat16(), fmt=fmt, kernels=KERNELS)
    x = torch.randn(17, 40, generator=torch.Generator().manual_seed(6))
    ref = x @ w.t()
    assert (linear(x.bfloat16()).float() - ref).abs().max() <= 0.02 * ref.abs().max()
