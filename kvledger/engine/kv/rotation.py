"""KV rotation: an orthogonal ``R`` [head_dim, head_dim] applied to every K and V row before it
is quantized, so that a few large channels are spread over all of them (QuaRot,
arXiv:2404.00456 §3; llama.cpp's attention rotation, PR #21038).

The pool holds ``k R`` and ``v R`` (row vectors; the residual buffers too). Attention over it
rotates the queries the same way, ``(q R) . (k R) = q . k`` (R orthogonal), and the output
back, ``(sum_t p_t v_t R) R^T = sum_t p_t v_t``: scores and output are those of the unrotated
K/V in exact arithmetic. The native kernel does both (``paged_attention.cpp``); every
other reader gets unrotated K/V from the store (``QuantizedKVStore.read_blocks``).

``hadamard``: the normalised Sylvester-Hadamard matrix ``H_n / sqrt(n)`` (symmetric,
``H H = I``; the matrix llama.cpp builds in ``ggml_gen_hadamard``), block-diagonal over the
largest power-of-two divisor of head_dim when head_dim is not a power of two (96 -> three
32 x 32 blocks). Rotation does not change a format's bytes: ``R`` is one constant per model.
"""

from __future__ import annotations

import torch

from kvledger.errors import InvalidParameterError

MIN_BLOCK = 8
"""Smallest Hadamard block: a head size whose largest power-of-two divisor is smaller (an odd
head size, say) is refused instead of rotated by a near-identity."""


def hadamard_block(head_dim: int) -> int:
    """The Hadamard block size for ``head_dim``: its largest power-of-two divisor.

    Raises:
        InvalidParameterError: that divisor is below :data:`MIN_BLOCK`.
    """
    block = head_dim & -head_dim
    if block < MIN_BLOCK:
        raise InvalidParameterError(
            f"--kv-rotation hadamard needs a head size with a power-of-two divisor >= "
            f"{MIN_BLOCK}; head_dim {head_dim} has {block}")
    return block


def hadamard(head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[head_dim, head_dim]: block-diagonal normalised Sylvester-Hadamard matrix.

    Raises:
        InvalidParameterError: see :func:`hadamard_block`.
    """
    n = hadamard_block(head_dim)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    blocks = torch.block_diag(*[h / n ** 0.5] * (head_dim // n))
    return blocks.to(dtype)


def rotation_matrix(name: str, head_dim: int) -> torch.Tensor | None:
    """The fp32 matrix of rotation ``name`` (``KVFormatSpec.rotation``), None for ``none``."""
    return None if name == "none" else hadamard(head_dim)
