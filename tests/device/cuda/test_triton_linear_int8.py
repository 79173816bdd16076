"""The Triton int8 weight-only product (``triton_kernels/linear_int8.py``) computes the ``int8``
weight format's ``y = (x @ q^T) x s_row`` (:mod:`kvledger.model.linear`), written out here in
fp32 as the oracle: exact to fp32 rounding on fp32 activations, within one bf16 step of the
result on bf16 ones; decode (one row) and prefill (rows past a tile) shapes, widths and
outputs that are not multiples of the tiles."""

from __future__ import annotations

import pytest
import torch

from kvledger.model.linear import int8_rows

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[cuda]')")
pytestmark = pytest.mark.triton


@pytest.mark.parametrize("rows,width,outputs", [(1, 64, 96), (5, 96, 200), (40, 128, 70)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_int8_product_is_the_formats_formula(dev, rows, width, outputs, dtype):
    from kvledger.device.cuda.triton_kernels.linear_int8 import int8_matmul

    g = torch.Generator().manual_seed(rows)
    codes, scales = int8_rows(torch.randn(outputs, width, generator=g))
    x = torch.randn(rows, width, generator=g).to(dtype)
    got = int8_matmul(x.to(dev), codes.to(dev), scales.to(dev))
    want = (x.float() @ codes.float().T) * scales
    assert got.dtype == dtype and got.shape == (rows, outputs)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2 ** -7,
                                                                       "atol": 1e-3}
    torch.testing.assert_close(got.cpu().float(), want, **tol)
