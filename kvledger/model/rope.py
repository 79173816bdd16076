"""Rotary position embeddings (RoPE), with Llama-3 frequency scaling.

RoPE: Su et al., "RoFormer" (arXiv:2104.09864). We use the "rotate half" layout of the Hugging
Face Llama implementation (the first and second halves of head_dim form the rotation pairs); GGUF
files store Q/K rows permuted for the interleaved layout and the loader undoes that.
Llama-3 scaling ("llama3" rope_type): Meta's Llama 3.1 reference code — low frequencies divided
by ``factor``, high ones kept, the band between smoothly interpolated.

The cos/sin tables are computed once in fp32 for every position up to the context limit and
cast to the model dtype, so a step only indexes them.
"""

from __future__ import annotations

import math

import torch

from kvledger.errors import UnsupportedModelError


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Per-pair inverse frequencies, shape [head_dim // 2], fp32.

    Raises:
        UnsupportedModelError: an unknown ``rope_type`` in ``scaling``.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables, each [max_positions, head_dim] in the model dtype."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype) -> None:
        self.inv_freq, self.dtype = inverse_frequencies(head_dim, theta, scaling), dtype
        self._tabulate(max_positions)

    def _tabulate(self, num_positions: int) -> None:
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), self.inv_freq)
        self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(self.dtype)
        # sin with the first half negated: rotate_half(x) * sin == roll(x, half) * signed_sin
        self.sin = torch.cat((-freqs, freqs), dim=-1).sin().to(self.dtype)
        # fp32 [positions, head_dim / 2] for the native op (kvledger.device.cpu.fused)
        self.cos_half, self.sin_half = freqs.cos().contiguous(), freqs.sin().contiguous()

    def cover(self, positions: torch.Tensor) -> None:
        """Make the tables reach ``positions`` [tokens]: positions past them (a retention policy
        generating past the context) double them."""
        if len(positions) and int(positions.max()) >= len(self.cos):
            self._tabulate(2 * (int(positions.max()) + 1))

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for positions [tokens] -> two [tokens, 1, head_dim] tensors (once
        a step), after :meth:`cover`."""
        self.cover(positions)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [tokens, heads, head_dim] by the angles of :meth:`lookup`.

        HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``, written as
        ``x * cos + roll(x, half) * signed_sin`` (sin(-a) = -sin(a)): three ops instead of seven.
        """
        rolled = torch.roll(x, x.shape[-1] // 2, dims=-1)
        return torch.addcmul(x * cos, rolled, sin)
