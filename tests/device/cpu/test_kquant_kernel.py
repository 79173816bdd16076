"""The native products with weights in GGUF's own blocks (``kquant_gemv.cpp``) against fp64
references on the weights as the ``gguf`` library dequantizes them (an independent
implementation of ggml's block formats).

The bound (:func:`_bound`), derived for y[r, o] = sum_i x[r, i] w[o, i] (W the dequantized weight):

1. Activations. The kernel rounds x per block B of inputs (256 for the K-quants, llama.cpp's
   Q8_K; 32 for the others) to codes a = round(x / d) with d = max_B |x| / 127, so
   |d a - x| <= d / 2 per input (the fp32 reciprocal and product move a code only at a tie,
   covered by a 2^-7 relative margin on d). Its exact integer dot products then give
   sum_i (x_i + e_i) w_i with |e_i| <= d_B / 2, an error of at most
   Q = sum_B (d_B / 2) (1 + 2^-7) sum_{i in B} |w_i|.
2. fp32 arithmetic. Each block's int32 sum is exact; the kernel scales it by fp32 products and
   adds the blocks in fp32. A weight splits into the parts the kernel scales separately
   (Q4_K / Q5_K: d sc q and dmin m; Q4_1 / Q5_1: e q and m; Q4_0 / Q5_0: e q and 8 e / 16 e;
   Q6_K and Q8_0: one part), and each part's terms are rounded a few times and summed over at
   most 64 blocks: at most (64 + 8) 2^-24 < 2^-16 of S = sum_i P_i (|x_i| + d_B / 2), with
   P_i the sum of the |parts| of w_i (the parts can cancel, so S, not |y|, bounds this).
3. The output is rounded to bf16: half an ulp, 2^-8 of |y_kernel| <= |y| + Q + S 2^-16.

So |y_kernel - y| <= Q + 2^-8 (|y| + Q) + 2^-16 S (1 + 2^-8), which ``_bound`` computes (with
2^-15 on S). Measured, the error stays near a tenth of it; a lost minimum, a swapped nibble,
a wrong sub-block scale or a mis-ordered row is far outside it.

A second reference emulates the kernel's own algorithm in fp64 (the same codes), which it must
meet to within its fp32 summation and bf16 rounding. Every path the build has (plain loops,
AVX2, AVX-512 VNNI) runs, with activation rows and weight rows that are and are not multiples
of the kernel's tiles (4 and 2 activation rows, one range of weight rows per thread), one or two
threads, and fused weights of several types.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvledger.device.cpu import kquant
from kvledger.model.kquant import BLOCK_TYPES, KQUANT_TYPES, random_matrix

MINIMUM_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q4_1": (0, 2), "Q5_1": (0, 2)}
"""(scale, minimum) fp16 byte offsets of the types whose weights have a minimum part."""


@pytest.fixture(scope="module")
def kernel():
    k = kquant.kernel()
    if k is None:
        from kvledger.device.cpu.native import why_unavailable

        pytest.skip(f"no native library here: {why_unavailable()}")
    return k


def _blocks(type_name, rows, in_f, seed):
    """Random blocks with fp16 scales (and minima) of varied size and sign, as a GGMLMatrix."""
    gen = torch.Generator().manual_seed(seed)
    m = random_matrix(type_name, rows, in_f, gen)
    size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]][1]
    b = m.data.view(-1, size)
    scale_at = (208,) if type_name == "Q6_K" else MINIMUM_AT.get(type_name, (0,))
    for at in scale_at:
        value = (torch.rand(b.shape[0], generator=gen) * 0.01 + 1e-4).half()
        if at == 2 and type_name in ("Q4_1", "Q5_1"):
            value = -value * 8  # a Q4_1 / Q5_1 minimum is negative as a rule
        b[:, at:at + 2] = value.view(torch.uint8).view(-1, 2)
    if type_name == "Q8_0":  # codes of a real file are within [-127, 127]; -128 is tested too
        b[:, 2] = 0x80
    return m


def _dequantized(m):
    """fp64 [rows, in] of a GGMLMatrix by the gguf library."""
    array = gguf_dequantize(m.data.numpy(), GGMLQuantizationType[m.type_name])
    return torch.from_numpy(np.asarray(array, dtype=np.float64).reshape(m.shape))


def _parts(m):
    """P [rows, in]: per weight the sum of the |parts| the kernel scales separately."""
    w = _dequantized(m)
    if m.type_name in MINIMUM_AT:
        parts = 0
        for zeroed in MINIMUM_AT[m.type_name]:
            data = m.data.clone()
            data.view(-1, GGML_QUANT_SIZES[GGMLQuantizationType[m.type_name]][1])[
                :, zeroed:zeroed + 2] = 0
            parts = parts + _dequantized(type(m)(m.type_name, data, m.in_features)).abs()
        return parts
    if m.type_name in ("Q4_0", "Q5_0"):
        size = GGML_QUANT_SIZES[GGMLQuantizationType[m.type_name]][1]
        e = m.data.view(-1, size)[:, 0:2].contiguous().view(torch.float16).double()
        offset = 8 if m.type_name == "Q4_0" else 16
        return w.abs() + 2 * offset * e.abs().reshape(m.shape[0], -1).repeat_interleave(32, 1)
    return w.abs()


def _block(type_name):
    return 256 if type_name in KQUANT_TYPES else 32


def _x(rows, in_f, block, seed):
    """bf16 activations whose blocks differ in size by up to 10^4, the last block all zeros."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** torch.randint(-3, 2, (rows, in_f // block, 1), generator=gen).float()
    x = torch.randn(rows, in_f // block, block, generator=gen) * magnitude
    x[:, -1] = 0.0
    return x.reshape(rows, in_f).bfloat16()


def _bound(x, w, parts, block):
    """The bound of the module docstring, [rows, out] fp64."""
    rows = x.shape[0]
    xd = x.double()
    half = xd.reshape(rows, -1, block).abs().amax(-1) / 127 / 2                  # [rows, B]
    quant = half @ w.abs().reshape(w.shape[0], -1, block).sum(-1).t() * (1 + 2 ** -7)
    exact = xd @ w.t()
    spread = (xd.abs() + half.repeat_interleave(block, 1)) @ parts.t()
    return exact, quant + (exact.abs() + quant) * 2 ** -8 + spread * 2 ** -15


def _emulated(x, w, block):
    """fp64 result of the kernel's algorithm: activations rounded to int8 per ``block`` as the
    kernel does (an IEEE 127 / amax, then round half to even), times the dequantized W."""
    rows, width = x.shape
    xb = x.float().reshape(rows, -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-127, 127)
    return (q.double() * (amax / 127).double()).reshape(rows, width) @ w.t()


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("rows,out_f,in_f", [(1, 37, 512), (3, 64, 768), (7, 21, 256)])
def test_each_path_meets_the_derived_bound(kernel, type_name, rows, out_f, in_f):
    m = _blocks(type_name, out_f, in_f, seed=rows)
    w, block = _dequantized(m), _block(type_name)
    x = _x(rows, in_f, block, seed=out_f)
    exact, bound = _bound(x, w, _parts(m), block)
    emulated = _emulated(x, w, block)
    for isa in kernel.isas:
        y = kernel.bind([(type_name, m.data)], in_f, isa)(x).double()
        assert ((y - exact).abs() <= bound).all(), (isa, ((y - exact).abs() / bound).max())
        slack = (emulated.abs() * 2 ** -8 + (x.double().abs() @ _parts(m).t()) * 2 ** -15)
        assert ((y - emulated).abs() <= slack).all(), isa


def test_the_bound_is_tight_enough_to_catch_a_lost_minimum(kernel):
    """The same blocks read as if their minima were zero fall far outside the bound."""
    m = _blocks("Q4_K", 32, 512, seed=1)
    x = _x(2, 512, 256, seed=2)
    exact, bound = _bound(x, _dequantized(m), _parts(m), 256)
    data = m.data.clone()
    data.view(-1, 144)[:, 2:4] = 0  # dmin = 0
    y = kernel.bind([("Q4_K", data)], 512, kernel.isas[-1])(x).double()
    assert ((y - exact).abs() > bound).any()


def test_fused_segments_of_several_types_and_threads(kernel):
    """Q4_K, Q6_K and Q8_0 rows fused in one weight (a layer's Q/K/V): each segment's columns
    equal its own product, on one thread and on two."""
    parts = [_blocks("Q4_K", 30, 512, 1), _blocks("Q6_K", 9, 512, 2), _blocks("Q8_0", 5, 512, 3)]
    x = _x(5, 512, 256, seed=4)
    for isa in kernel.isas:
        alone = torch.cat([kernel.bind([(p.type_name, p.data)], 512, isa)(x) for p in parts], 1)
        fused = kernel.bind([(p.type_name, p.data) for p in parts], 512, isa)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(fused(x), alone)


def test_paths_agree_to_summation_order(kernel):
    m = _blocks("Q5_K", 48, 1024, seed=5)
    x = _x(4, 1024, 256, seed=6)
    ys = [kernel.bind([("Q5_K", m.data)], 1024, isa)(x).float() for isa in kernel.isas]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], rtol=2 ** -7, atol=1e-3 * ys[0].abs().max().item())


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_dequantization_is_ggml_bit_for_bit(kernel, type_name):
    m = _blocks(type_name, 13, 512, seed=7)
    reference = _dequantized(m).float()
    assert torch.equal(kernel.dequantize(type_name, m.data, 512, torch.float32), reference)
    assert torch.equal(kernel.dequantize(type_name, m.data, 512, torch.bfloat16),
                       reference.bfloat16())


def test_bad_weights_are_refused(kernel):
    m = _blocks("Q4_K", 4, 512, seed=0)
    with pytest.raises(ValueError, match="Q4_K segment"):
        kernel.bind([("Q4_K", m.data[:, :100])], 512, kernel.isas[0])
    with pytest.raises(ValueError, match="does not take"):
        kernel.bind([("Q2_K", m.data)], 512, kernel.isas[0])
    with pytest.raises(ValueError, match="no 'sse9' path"):
        kernel.bind([("Q4_K", m.data)], 512, "sse9")
    with pytest.raises(ValueError, match="bf16 x"):
        kernel.bind([("Q4_K", m.data)], 512, kernel.isas[0])(torch.zeros(1, 512))
