"""The native int8 x int8 decode product (``w8a8``) against fp64 references of the same weights.

Two references: (1) the exact product x @ (codes * s).T, which the kernel must meet within the
bound derived from rounding each activation to int8 per block of 32 (``w8a8.rounding_bound``);
(2) the same integer algorithm emulated here in fp64 (codes computed the way the kernel does),
which it must meet to its fp32 summation and the bf16 output rounding. Inputs mix blocks whose
magnitudes differ by 10^4, with an all-zero block, so a per-row instead of per-block activation
scale, a lost sign or a lane order mistake fails. Both the AVX2 and the plain-loop paths run.
"""

from __future__ import annotations

import pytest
import torch

from kvledger.engine import w8a8
from kvledger.engine.linear import Linear, int8_rows


@pytest.fixture(scope="module")
def kernel():
    k = w8a8.kernel()
    assert k is not None  # g++ is part of this project's machines
    return k


def _case(rows, out_f, in_f, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = in_f // w8a8.BLOCK
    magnitude = 10.0 ** torch.randint(-3, 2, (rows, blocks, 1), generator=gen).float()
    x = torch.randn(rows, blocks, w8a8.BLOCK, generator=gen) * magnitude
    x[:, -1] = 0.0  # a block of zeros: scale 0, codes 0
    x = x.reshape(rows, in_f).bfloat16()
    codes, scales = int8_rows(torch.randn(out_f, in_f, generator=gen) * 0.05)
    return x, codes, scales


def _emulated(x, codes, scales, per_row=False):
    """fp64 result of the kernel's algorithm (per-row activation scales if ``per_row``)."""
    rows, in_f = x.shape
    xb = x.float().reshape(rows, -1 if not per_row else 1, w8a8.BLOCK if not per_row else in_f)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-127, 127)
    d = (amax / 127).double()
    deq = (q.double() * d).reshape(rows, in_f)
    return deq @ (codes.double() * scales.double()[:, None]).t()


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("rows,out_f,in_f", [(1, 64, 96), (2, 70, 128), (3, 33, 64),
                                             (5, 130, 1536), (8, 257, 576)])
def test_kernel_is_the_block_int8_product_within_its_rounding_bound(kernel, scalar, rows, out_f,
                                                                    in_f):
    x, codes, scales = _case(rows, out_f, in_f, seed=rows)
    got = kernel(x, codes, scales, scalar=scalar).double()
    exact = x.double() @ (codes.double() * scales.double()[:, None]).t()
    assert ((got - exact).abs() <= w8a8.rounding_bound(x, codes, scales)).all()
    emulated = _emulated(x, codes, scales)
    terms = x.double().abs() @ (codes.double().abs() * scales.double()[:, None]).t()
    assert ((got - emulated).abs() <= emulated.abs() * 2 ** -8 + terms * 2 ** -16).all()


def test_the_emulation_check_tells_a_per_row_scale_apart():
    """The emulated check above is tight enough to catch the likeliest mistake (one activation
    scale per row instead of per block), which the worst-case bound alone may not."""
    x, codes, scales = _case(4, 64, 512, seed=9)
    block, row = _emulated(x, codes, scales), _emulated(x, codes, scales, per_row=True)
    terms = x.double().abs() @ (codes.double().abs() * scales.double()[:, None]).t()
    assert ((row - block).abs() > block.abs() * 2 ** -8 + terms * 2 ** -16).any()


def test_paths_threads_and_batch_give_the_same_rows(kernel):
    """AVX2 and plain loops agree to fp32 summation order; a row's result depends on neither
    the thread count nor the other rows of the batch (bit for bit)."""
    x, codes, scales = _case(6, 1024, 256, seed=3)  # 256 KiB of codes: threaded
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernel(x, codes, scales)
        torch.set_num_threads(1)
        one = kernel(x, codes, scales)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    alone = torch.cat([kernel(x[i:i + 1], codes, scales) for i in range(len(x))])
    assert torch.equal(alone, two)
    plain = kernel(x, codes, scales, scalar=True).float()
    assert ((plain - two.float()).abs() <= 2 ** -7 * two.float().abs() + 1e-6).all()


def test_bad_arguments_are_refused(kernel):
    x, codes, scales = _case(1, 8, 64)
    with pytest.raises(ValueError):
        kernel(x.float(), codes, scales)
    with pytest.raises(ValueError):
        kernel(x[:, :48], codes[:, :48], scales)
    with pytest.raises(ValueError):
        kernel.bind(codes, scales)(x[:, :32])
    with pytest.raises(ValueError):
        kernel.bind(codes.t(), scales)


def test_linear_keeps_one_int8_copy_and_falls_back_without_the_kernel(monkeypatch):
    w = (torch.randn(48, 64, generator=torch.Generator().manual_seed(4)) * 0.1).bfloat16()
    linear = Linear(w, fmt="w8a8")
    assert linear.format == "w8a8" and linear.weight is None
    assert linear.scales.dtype == torch.float32
    ids = torch.tensor([0, 47])
    assert torch.equal(linear.rows(ids, torch.float32),
                       linear.packed[ids].float() * linear.scales[ids, None])
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(linear(x), w8a8.kernel()(x, linear.packed, linear.scales))
    assert Linear(w[:, :48], fmt="w8a8").format == "int8"  # not whole blocks of 32
    monkeypatch.setattr(w8a8, "kernel", lambda: None)
    assert Linear(w, fmt="w8a8").format == "int8"
