"""The ``w8a8`` and ``w4a8`` weights repacked at load (``kvledger.device.cpu.repack``,
``interleaved_gemv.h``).

The layout is checked byte by byte against its specification (written out here by loops), the
products against exact integer arithmetic (scales powers of two and activations whose block
maximum is 127, so every partial sum is a number fp32 holds exactly and the only rounding is the
output's to bf16, which torch does here), and every built path (plain loops, AVX2, AVX-512 VNNI)
against the others bit for bit. A code in the wrong lane, row, block or nibble, a lost sign,
scale or minimum, or a wrong tail group fails them.
"""

from __future__ import annotations

import pytest
import torch

from kvledger.device.cpu import repack, w8a8
from kvledger.model.q4 import q4_blocks, q4_dequantize


@pytest.fixture(scope="module")
def kernel():
    k = w8a8.kernel()
    assert k is not None  # g++ is part of this project's machines
    return k


def _q4_parts(out, in_f, seed, exact=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, in_f), dtype=torch.uint8, generator=gen)
    if exact:  # e in {1/2, 1, 2}, m integer: every product and sum exact in fp32
        scale = 2.0 ** torch.randint(-1, 2, (out, in_f // 32), generator=gen).float()
        zero = torch.randint(-20, 20, (out, in_f // 32), generator=gen).float() + 8 * scale
    else:
        scale = torch.rand(out, in_f // 32, generator=gen) * 0.02
        zero = torch.randn(out, in_f // 32, generator=gen) * 0.05
    return q4_blocks(q, scale, zero)


def _q8_parts(out, in_f, seed, exact=False):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out, in_f), dtype=torch.int8, generator=gen)
    scales = (2.0 ** torch.randint(-1, 2, (out, in_f // 32), generator=gen).float() if exact
              else torch.rand(out, in_f // 32, generator=gen) * 0.01)
    return codes, scales


def _q8_dense(codes, scales):
    return codes.double() * scales.double().repeat_interleave(32, 1)


@pytest.mark.parametrize("n", [16, 32])
def test_the_layout_is_the_specified_interleave(n):
    gen = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 256, (21, 2, n), dtype=torch.uint8, generator=gen)
    floats = [torch.randn(21, 2, generator=gen) for _ in range(2)]
    packed = repack.repack(codes, *floats)  # 3 groups, the last with 5 rows and 3 padding rows
    assert packed.shape == (3, 2, 8 * n + 64) and packed.dtype == torch.uint8
    for g in range(3):
        for b in range(2):
            rec = packed[g, b]
            stored = rec[8 * n:].contiguous().view(torch.float32)
            for t in range(8):
                o = 8 * g + t
                for c in range(n // 4):
                    want = codes[o, b, 4 * c:4 * c + 4] if o < 21 else torch.zeros(4)
                    assert torch.equal(rec[32 * c + 4 * t:32 * c + 4 * t + 4],
                                       want.to(torch.uint8))
                for i in range(2):
                    assert stored[8 * i + t] == (floats[i][o, b] if o < 21 else 0.0)


def test_unpack_gives_the_rows_back():
    qs, e, m = _q4_parts(37, 96, seed=2)
    packed = repack.repack(qs.view(37, 3, 16), e, m)
    for ids in (torch.tensor([36, 0, 8, 7, 9, 36]), torch.arange(37), torch.tensor([], dtype=int)):
        codes, got_e, got_m = repack.unpack(packed, ids, 16)
        assert torch.equal(codes.flatten(1), qs[ids])
        assert torch.equal(got_e, e[ids]) and torch.equal(got_m, m[ids])


def _exact_x(rows, in_f, seed):
    """bf16 x [rows, in] of integers in [-127, 127] with 127 in every block (activation scale
    1: the int8 codes are x)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (rows, in_f // 32, 32), generator=gen)
    x[:, :, 5] = 127
    return x.reshape(rows, in_f)


@pytest.mark.parametrize("fmt", ["w4a8", "w8a8"])
@pytest.mark.parametrize("rows,out,in_f", [(1, 37, 64), (3, 64, 256), (7, 13, 2048),
                                           (1, 1536, 576)])
def test_every_path_is_the_exact_integer_product(kernel, fmt, rows, out, in_f):
    x = _exact_x(rows, in_f, seed=rows + out)
    if fmt == "w4a8":
        parts = _q4_parts(out, in_f, rows + out, exact=True)
        bound, w = kernel.bind_q4(*parts), q4_dequantize(*parts).double()  # exact
    else:
        parts = _q8_parts(out, in_f, rows + out, exact=True)
        bound, w = kernel.bind(*parts), _q8_dense(*parts)
    want = (x.double() @ w.t()).to(torch.bfloat16)
    assert "scalar" in kernel.paths
    for path in kernel.paths:
        assert torch.equal(bound(x.bfloat16(), path=path), want), path


@pytest.mark.parametrize("fmt", ["w4a8", "w8a8"])
def test_paths_threads_and_batches_agree_bit_for_bit(kernel, fmt):
    # threaded (>= 64 KiB of codes), a tail group of 3 rows
    bound = (kernel.bind_q4(*_q4_parts(203, 1536, seed=3)) if fmt == "w4a8"
             else kernel.bind(*_q8_parts(203, 1536, seed=3)))
    gen = torch.Generator().manual_seed(4)
    magnitude = 10.0 ** torch.randint(-3, 2, (6, 48, 1), generator=gen).float()
    x = (torch.randn(6, 48, 32, generator=gen) * magnitude).reshape(6, 1536).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = bound(x)
        torch.set_num_threads(1)
        one = {path: bound(x, path=path) for path in kernel.paths}
    finally:
        torch.set_num_threads(threads)
    for path, got in one.items():
        assert torch.equal(got, two), path
    assert torch.equal(torch.cat([bound(x[i:i + 1]) for i in range(6)]), two)
    assert kernel.path in kernel.paths and kernel.path != "scalar"


def test_the_dense_weight_and_rows_come_from_the_repacked_blocks(kernel):
    qs, e, m = _q4_parts(45, 128, seed=5)
    bound = kernel.bind_q4(qs, e, m)
    dense = q4_dequantize(qs, e, m)
    assert torch.equal(bound.dense_bf16(), dense.bfloat16())
    ids = torch.tensor([44, 3])
    assert torch.equal(q4_dequantize(*bound.blocks(ids)), dense[ids])
    codes, scales = _q8_parts(45, 128, seed=6)
    bound = kernel.bind(codes, scales)
    assert torch.equal(bound.dense_bf16(), _q8_dense(codes, scales).float().bfloat16())
    got_codes, got_scales = bound.blocks(ids)
    assert torch.equal(got_codes, codes[ids]) and torch.equal(got_scales, scales[ids])


def test_an_unbuilt_path_is_refused(kernel):
    bound = kernel.bind_q4(*_q4_parts(8, 32, seed=6))
    with pytest.raises(ValueError, match="not built"):
        bound(torch.ones(1, 32).bfloat16(), path="amx")
