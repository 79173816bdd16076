"""The ``w4a8`` weight repacked at load (``kvledger.device.cpu.q4_repack``, ``w4a8_gemv.h``).

The layout is checked byte by byte against its specification (written out here by loops), the
product against exact integer arithmetic (scales powers of two and activations whose block
maximum is 127, so every partial sum is an integer fp32 holds exactly and the only rounding is
the output's to bf16, which torch does here), and every built path (plain loops, AVX2,
AVX-512 VNNI) against the others bit for bit. A code in the wrong lane, row, block or nibble, a
lost scale or minimum, or a wrong tail group fails them.
"""

from __future__ import annotations

import pytest
import torch

from kvledger.device.cpu import q4_repack, w8a8
from kvledger.model.q4 import q4_blocks, q4_dequantize


@pytest.fixture(scope="module")
def kernel():
    k = w8a8.kernel()
    assert k is not None  # g++ is part of this project's machines
    return k


def _parts(out, in_f, seed, exact=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, in_f), dtype=torch.uint8, generator=gen)
    if exact:  # e in {1/2, 1, 2}, m integer: every product and sum an exact fp32 integer / half
        scale = 2.0 ** torch.randint(-1, 2, (out, in_f // 32), generator=gen).float()
        zero = torch.randint(-20, 20, (out, in_f // 32), generator=gen).float() + 8 * scale
    else:
        scale = torch.rand(out, in_f // 32, generator=gen) * 0.02
        zero = torch.randn(out, in_f // 32, generator=gen) * 0.05
    return q4_blocks(q, scale, zero)


def test_the_layout_is_the_specified_interleave():
    qs, e, m = _parts(21, 64, seed=1)  # 3 groups, the last with 5 rows and 3 padding rows
    packed = q4_repack.repack(qs, e, m)
    assert packed.shape == (3, 2, 192) and packed.dtype == torch.uint8
    for g in range(3):
        for b in range(2):
            rec = packed[g, b]
            floats = rec[128:].contiguous().view(torch.float32)
            for t in range(8):
                o = 8 * g + t
                for k in range(4):
                    want = qs[o, 16 * b + 4 * k:16 * b + 4 * k + 4] if o < 21 else torch.zeros(4)
                    assert torch.equal(rec[32 * k + 4 * t:32 * k + 4 * t + 4], want.to(torch.uint8))
                assert floats[t] == (e[o, b] if o < 21 else 0.0)
                assert floats[8 + t] == (m[o, b] if o < 21 else 0.0)


def test_unpack_gives_the_rows_back():
    qs, e, m = _parts(37, 96, seed=2)
    packed = q4_repack.repack(qs, e, m)
    ids = torch.tensor([36, 0, 8, 7, 9, 36])
    for got, want in zip(q4_repack.unpack(packed, ids), (qs, e, m)):
        assert torch.equal(got, want[ids])
    for got, want in zip(q4_repack.unpack(packed, torch.arange(37)), (qs, e, m)):
        assert torch.equal(got, want)


def _exact_case(rows, out, in_f, seed):
    """bf16 x [rows, in] of integers in [-127, 127] with 127 in every block (activation scale
    1: the int8 codes are x), the Q4 parts, and the exact product rounded once to bf16."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (rows, in_f // 32, 32), generator=gen)
    x[:, :, 5] = 127
    x = x.reshape(rows, in_f)
    qs, e, m = _parts(out, in_f, seed, exact=True)
    w = q4_dequantize(qs, e, m).double()  # e * code + m: exact
    return x.bfloat16(), (qs, e, m), (x.double() @ w.t()).to(torch.bfloat16)


@pytest.mark.parametrize("rows,out,in_f", [(1, 37, 64), (3, 64, 256), (7, 13, 2048),
                                           (1, 1536, 576)])
def test_every_path_is_the_exact_integer_product(kernel, rows, out, in_f):
    x, parts, want = _exact_case(rows, out, in_f, seed=rows + out)
    bound = kernel.bind_q4(*parts)
    assert set(kernel.q4_paths) >= {"scalar"}
    for path in kernel.q4_paths:
        assert torch.equal(bound(x, path=path), want), path


def test_paths_threads_and_batches_agree_bit_for_bit(kernel):
    qs, e, m = _parts(203, 1536, seed=3)  # threaded (>= 64 KiB), a tail group of 3 rows
    bound = kernel.bind_q4(qs, e, m)
    gen = torch.Generator().manual_seed(4)
    magnitude = 10.0 ** torch.randint(-3, 2, (6, 48, 1), generator=gen).float()
    x = (torch.randn(6, 48, 32, generator=gen) * magnitude).reshape(6, 1536).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = bound(x)
        torch.set_num_threads(1)
        one = {path: bound(x, path=path) for path in kernel.q4_paths}
    finally:
        torch.set_num_threads(threads)
    for path, got in one.items():
        assert torch.equal(got, two), path
    assert torch.equal(torch.cat([bound(x[i:i + 1]) for i in range(6)]), two)
    assert kernel.q4_path in kernel.q4_paths and kernel.q4_path != "scalar"


def test_the_dense_weight_and_rows_come_from_the_repacked_blocks(kernel):
    qs, e, m = _parts(45, 128, seed=5)
    bound = kernel.bind_q4(qs, e, m)
    dense = q4_dequantize(qs, e, m)
    assert torch.equal(bound.dense_bf16(), dense.bfloat16())
    ids = torch.tensor([44, 3])
    assert torch.equal(q4_dequantize(*bound.blocks(ids)), dense[ids])


def test_an_unbuilt_path_is_refused(kernel):
    bound = kernel.bind_q4(*_parts(8, 32, seed=6))
    with pytest.raises(ValueError, match="not built"):
        bound(torch.ones(1, 32).bfloat16(), path="amx")
