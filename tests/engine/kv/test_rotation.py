"""KV rotation (``engine/kv/rotation.py``): Hadamard K/V in the quantized store.

Oracles: scipy's Sylvester-Hadamard matrix, scores and outputs of attention computed in fp64
on unrotated K/V, and the round-trip error of a key with an outlier channel (rotation spreads
it: QuaRot, arXiv:2404.00456). The rotated store in the engine is tested in
``test_quantized_engine.py``.
"""

from __future__ import annotations

import pytest
import scipy.linalg
import torch

from kvledger.engine.kv.codecs import make_codecs
from kvledger.engine.kv.rotation import hadamard
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import vector_bytes
from kvledger.ledger.kv_format import KVFormatSpec


@pytest.mark.parametrize("head_dim, block", [(64, 64), (128, 128), (96, 32), (48, 16)])
def test_hadamard_is_scipys_sylvester_matrix_block_diagonal(head_dim, block):
    want = torch.block_diag(*[torch.from_numpy(scipy.linalg.hadamard(block)).double() / block ** 0.5]
                            * (head_dim // block))
    assert torch.equal(hadamard(head_dim, torch.float64), want)


@pytest.mark.parametrize("head_dim", [64, 96])
def test_rotation_leaves_scores_and_output_unchanged_in_fp64(head_dim):
    """softmax(q K^T) V == R^T-rotated softmax((q R)(K R)^T) (V R), to fp64 rounding."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, head_dim, generator=g, dtype=torch.float64) for n in (4, 50, 50))
    r = hadamard(head_dim, torch.float64)
    scores, rotated = q @ k.T, (q @ r) @ (k @ r).T
    assert torch.allclose(rotated, scores, rtol=0, atol=1e-12)
    out = torch.softmax(scores, -1) @ v
    out_rot = (torch.softmax(rotated, -1) @ (v @ r)) @ r.T
    assert torch.allclose(out_rot, out, rtol=0, atol=1e-12)


def test_key_turn_applies_to_unrotated_keys_in_fp64():
    """A RoPE turn (``--kv-positions cache``) of the keys the store returns (rotated back)
    equals the turn of the original keys; turning the stored rotated keys would not (RoPE and
    a Hadamard do not commute), which is why the store rotates back before any reader."""
    from kvledger.model.layers.rotary import RotaryEmbedding

    d = 64
    rope = RotaryEmbedding(d, 256, 10000.0, None, torch.float64)
    cos, sin = rope.lookup(torch.tensor([7]))
    k = torch.randn(5, 1, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    r = hadamard(d, torch.float64)
    turned = RotaryEmbedding.apply(k, cos, sin)
    assert torch.allclose(RotaryEmbedding.apply((k @ r) @ r.T, cos, sin), turned, atol=1e-12)
    assert not torch.allclose(RotaryEmbedding.apply(k @ r, cos, sin) @ r.T, turned, atol=1e-3)


def test_rotation_spreads_an_outlier_channel():
    """int4 keys with one channel 30x the rest: the round trip's error drops with rotation."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 16, 2, 64, generator=g)
    x[..., 5] *= 30
    keys, _ = make_codecs("int4", 16, 2, 64, 32, "per-token")
    r = hadamard(64)

    def error(y, back):
        return float((keys.decode(keys.encode(y), torch.float32) @ back - x).norm() / x.norm())

    assert error(x @ r, r.T) < 0.5 * error(x, torch.eye(64))


def test_rotation_refused_for_a_head_size_without_a_power_of_two_block_and_on_mla():
    with pytest.raises(InvalidParameterError, match="head_dim 12 has 4"):
        hadamard(12)
    with pytest.raises(InvalidParameterError, match="not supported on MLA"):
        vector_bytes(576, KVFormatSpec("int4", rotation="hadamard"))


