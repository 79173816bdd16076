"""The native decode products with int8 activations (``w8a8``: int8 weight rows; ``w4a8``: the
GGUF's Q4 blocks) against fp64 references of the same weights.

Two references: (1) the exact product x @ W.T (W = codes * s; for w4a8 the blocks as the gguf
library dequantizes them), which the kernel must meet within the
bound derived from rounding each activation to int8 per block of 32 (``w8a8.rounding_bound``);
(2) the same integer algorithm emulated here in fp64 (codes computed the way the kernel does),
which it must meet to its fp32 summation and the bf16 output rounding. Inputs mix blocks whose
magnitudes differ by 10^4, with an all-zero block, so a per-row instead of per-block activation
scale, a lost sign or a lane order mistake fails (and for w4a8 a swapped nibble order or a lost
minimum). Both the AVX2 and the plain-loop paths run.
"""

from __future__ import annotations

import pytest
import torch

from kvledger.device.cpu import w8a8
from kvledger.device.cpu.kernels import KERNELS
from kvledger.model.linear import Linear, int8_blocks
from kvledger.model.q4 import q4_blocks, q4_parts


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
    codes, scales = int8_blocks(torch.randn(out_f, in_f, generator=gen) * 0.05)
    return x, codes, scales


def _emulated(x, weight, per_row=False):
    """fp64 result of the kernels' algorithm on a dense fp64 ``weight`` [out, in] (per-row
    activation scales if ``per_row``)."""
    rows, in_f = x.shape
    xb = x.float().reshape(rows, -1 if not per_row else 1, w8a8.BLOCK if not per_row else in_f)
    amax = xb.abs().amax(-1, keepdim=True)
    # tensor / tensor: an IEEE division like the kernel's (127 / tensor multiplies by a reciprocal)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-127, 127)
    d = (amax / 127).double()
    deq = (q.double() * d).reshape(rows, in_f)
    return deq @ weight.t()


def _int8_weight(codes, scales):
    return codes.double() * scales.double().repeat_interleave(w8a8.BLOCK, 1)


def _check(got, x, weight):
    """Within the rounding bound of the exact product, and near the emulated algorithm."""
    got = got.double()
    exact = x.double() @ weight.t()
    assert ((got - exact).abs() <= w8a8.rounding_bound(x, weight)).all()
    emulated = _emulated(x, weight)
    terms = x.double().abs() @ weight.abs().t()
    assert ((got - emulated).abs() <= emulated.abs() * 2 ** -8 + terms * 2 ** -16).all()


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("rows,out_f,in_f", [(1, 64, 96), (2, 70, 128), (3, 33, 64),
                                             (5, 130, 1536), (8, 257, 576)])
def test_kernel_is_the_block_int8_product_within_its_rounding_bound(kernel, scalar, rows, out_f,
                                                                    in_f):
    x, codes, scales = _case(rows, out_f, in_f, seed=rows)
    _check(kernel(x, codes, scales, scalar=scalar), x, _int8_weight(codes, scales))


def test_the_emulation_check_tells_a_per_row_scale_apart():
    """The emulated check above is tight enough to catch the likeliest mistake (one activation
    scale per row instead of per block), which the worst-case bound alone may not."""
    x, codes, scales = _case(4, 64, 512, seed=9)
    weight = _int8_weight(codes, scales)
    block, row = _emulated(x, weight), _emulated(x, weight, per_row=True)
    terms = x.double().abs() @ weight.abs().t()
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
    linear = Linear(w, fmt="w8a8", kernels=KERNELS)
    assert linear.format == "w8a8" and linear.weight is None
    codes, scales = int8_blocks(w)
    assert linear.nbytes == codes.nbytes + scales.nbytes  # one copy: repacked codes + scales
    ids = torch.tensor([0, 47])
    assert torch.equal(linear.rows(ids, torch.float32),  # one rounding of code x scale
                       _int8_weight(codes, scales)[ids].float())
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(linear(x), w8a8.kernel()(x, codes, scales))
    assert Linear(w[:, :48], fmt="w8a8", kernels=KERNELS).format == "int8"  # not whole blocks of 32
    monkeypatch.setattr(w8a8, "kernel", lambda: None)
    assert Linear(w, fmt="w8a8", kernels=KERNELS).format == "int8"


@pytest.fixture(scope="module")
def gguf_q4(bundled_path):
    """A real Q4_1 matrix of the bundled GGUF (576 x 1536): its parts (ours) and its dense form
    (the gguf library's dequantization), fp64."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(bundled_path))
    tensor = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    rows = int(tensor.shape[1])
    parts = [torch.from_numpy(a) for a in q4_parts(tensor.data, tensor.tensor_type.name, rows)]
    dense = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(rows, -1))
    return parts, dense.double()


@pytest.mark.parametrize("scalar", [False, True])
@pytest.mark.parametrize("rows,out_f", [(1, 576), (2, 100), (3, 37), (8, 576)])
def test_w4a8_is_the_gguf_weight_times_int8_activations(kernel, gguf_q4, scalar, rows, out_f):
    (q, scale, zero), dense = gguf_q4
    bound = kernel.bind_q4(*q4_blocks(q[:out_f], scale[:out_f], zero[:out_f]))
    x, _, _ = _case(rows, 4, q.shape[1], seed=rows)
    _check(bound(x, scalar=scalar), x, dense[:out_f])


def test_w4a8_takes_q4_0_blocks_and_a_swapped_nibble_order_fails_the_check(kernel):
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (40, 128), generator=gen, dtype=torch.uint8)
    scale = torch.rand(40, 4, generator=gen) * 0.02
    zero = torch.zeros(40, 4)  # Q4_0: w = d * (q - 8)
    dense = ((q.double() - 8) * scale.double().repeat_interleave(32, 1))
    x, _, _ = _case(3, 4, 128, seed=6)
    got = kernel.bind_q4(*q4_blocks(q, scale, zero))(x)
    _check(got, x, dense)
    swapped = q.view(40, 4, 2, 16).flip(2).reshape(40, 128)
    wrong = ((swapped.double() - 8) * scale.double().repeat_interleave(32, 1))
    with pytest.raises(AssertionError):
        _check(got, x, wrong)


def test_w4a8_paths_threads_and_batch_give_the_same_rows(kernel, gguf_q4):
    (q, scale, zero), _ = gguf_q4
    bound = kernel.bind_q4(*q4_blocks(q, scale, zero))  # 576 x 1536: threaded
    x, _, _ = _case(5, 4, q.shape[1], seed=7)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = bound(x)
        torch.set_num_threads(1)
        one = bound(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(torch.cat([bound(x[i:i + 1]) for i in range(len(x))]), two)
    plain = bound(x, scalar=True).float()
    assert ((plain - two.float()).abs() <= 2 ** -7 * two.float().abs() + 1e-6).all()


def test_w4a8_refuses_bad_parts(kernel, gguf_q4):
    (q, scale, zero), _ = gguf_q4
    qs, e, m = q4_blocks(q[:8], scale[:8], zero[:8])
    with pytest.raises(ValueError):
        kernel.bind_q4(qs, e.double(), m)
    with pytest.raises(ValueError):
        kernel.bind_q4(qs[:, :40], e, m)
    with pytest.raises(ValueError):
        kernel.bind_q4(qs, e[:, :3], m)


def test_linear_w4a8_keeps_the_blocks_once_and_falls_back_to_int4(monkeypatch, gguf_q4):
    (q, scale, zero), dense = gguf_q4
    q4 = (q[:64], scale[:64], zero[:64])
    linear = Linear(dense[:64].bfloat16(), None, q4, "w4a8", kernels=KERNELS)
    assert linear.format == "w4a8" and linear.weight is None
    assert linear.nbytes == 64 * 1536 // 2 + 2 * 64 * 48 * 4  # nibbles + fp32 scale, minimum
    ids = torch.tensor([0, 63])
    assert (linear.rows(ids, torch.float32).double() - dense[ids]).abs().max() < 1e-6
    x = torch.randn(70, 1536, generator=torch.Generator().manual_seed(8)).bfloat16()
    exact = x.double() @ dense[:64].t()
    gemm = linear.gemm(x, "fp32").double()  # prefill path: the same weight, x not rounded
    assert ((gemm - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()
    assert Linear.from_q4(q4, (64, 1536), None, "w4a8", kernels=KERNELS).format == "w4a8"
    monkeypatch.setattr(w8a8, "kernel", lambda: None)
    assert Linear(dense[:64].bfloat16(), None, q4, "w4a8", kernels=KERNELS).format == "int4"
    assert Linear.from_q4(q4, (64, 1536), None, "w4a8", kernels=KERNELS).format == "int4"


def test_int8_blocks_give_back_the_files_q8_0_codes(bundled_path):
    """The bundled GGUF's token embedding is Q8_0: quantizing its bf16 rows per block of 32
    recovers the file's own codes (the gguf library's blocks: fp16 scale + 32 int8)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(bundled_path))
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type.name == "Q8_0"
    blocks = np.asarray(tensor.data).reshape(-1, 34)[:2000 * 18]  # the first 2,000 rows
    file_codes = torch.from_numpy(blocks[:, 2:].copy().view(np.int8)).reshape(2000, 576)
    dense = dequantize(blocks.reshape(2000, -1), tensor.tensor_type).reshape(2000, 576)
    codes, scales = int8_blocks(torch.from_numpy(dense).bfloat16())
    assert torch.equal(codes, file_codes)
    file_scales = torch.from_numpy(blocks[:, :2].copy().view(np.float16).astype(np.float32))
    assert torch.allclose(scales.reshape(-1), file_scales.reshape(-1), rtol=2 ** -8)


@pytest.mark.parametrize("native", [True, False])
def test_bf16_weight_of_the_gguf_blocks_is_each_weight_rounded_once(monkeypatch, gguf_q4, native):
    """The bf16 GEMM path's weight (``dequant_bf16.cpp``, or PyTorch without it) against the
    gguf library's dequantization of the same blocks: within half a bf16 ulp (2^-8 of it, and
    1e-7 for the minimum the file's fp16 parts give in fp32); a w8a8 weight's against its own
    codes x scales the same way."""
    (q, scale, zero), dense = gguf_q4
    w4 = Linear(dense[:64].bfloat16(), None, (q[:64], scale[:64], zero[:64]), "w4a8",
                kernels=KERNELS)
    w8 = Linear(dense[:64].bfloat16(), None, None, "w8a8", kernels=KERNELS)
    codes = _int8_weight(*w8._native.blocks())  # the parts bound, from the repacked weight
    if not native:
        monkeypatch.setattr(w8a8, "kernel", lambda: None)
    for linear, expected in ((w4, dense[:64].double()), (w8, codes)):
        got = linear.dense_weight(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and got.shape == expected.shape
        assert ((got.double() - expected).abs() <= expected.abs() * 2 ** -8 + 1e-7).all()


def _experts(kernel, n, out_f, in_f, seed=5):
    gen = torch.Generator().manual_seed(seed)
    parts = [int8_blocks(torch.randn(out_f, in_f, generator=gen) * 0.05) for _ in range(n)]
    return parts, kernel.bind_grouped([kernel.bind(c, s) for c, s in parts])


@pytest.mark.parametrize("scalar", [False, True])
def test_grouped_product_is_each_rows_own_experts_product(kernel, scalar):
    """Rows [starts[g], starts[g + 1]) times expert experts[g] (unsorted, one repeated, one
    group empty): within the rounding bound of the exact product with that expert's weight, and
    bit for bit the rows the one-weight kernel gives, at 1 and 2 threads."""
    parts, group = _experts(kernel, 6, 200, 256)
    x, _, _ = _case(7, 8, 256, seed=11)
    experts = torch.tensor([4, 0, 5, 2, 4], dtype=torch.int64)
    starts = torch.tensor([0, 1, 3, 3, 6, 7], dtype=torch.int64)
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(group(x, experts, starts, scalar=scalar))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0], got[1])
    for e, r0, r1 in zip(experts.tolist(), starts[:-1].tolist(), starts[1:].tolist()):
        codes, scales = parts[e]
        if r1 > r0:
            _check(got[0][r0:r1], x[r0:r1], _int8_weight(codes, scales))
            assert torch.equal(got[0][r0:r1], kernel(x[r0:r1], codes, scales, scalar=scalar))


def test_grouped_product_refuses_bad_groups(kernel):
    parts, group = _experts(kernel, 3, 16, 64)
    x, _, _ = _case(4, 8, 64)
    i64 = {"dtype": torch.int64}
    for experts, starts in ([[0, 3], [0, 2, 4]], [[0, -1], [0, 2, 4]], [[0, 1], [0, 3, 2]],
                            [[0, 1], [0, 2, 3]], [[0, 1], [1, 2, 4]]):
        with pytest.raises(ValueError, match="experts must lie"):
            group(x, torch.tensor(experts, **i64), torch.tensor(starts, **i64))
    with pytest.raises(ValueError):
        group(x, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 2, 4], **i64))
    with pytest.raises(ValueError):
        kernel.bind_grouped([kernel.bind(*parts[0]), kernel.bind(*int8_blocks(torch.ones(8, 64)))])
