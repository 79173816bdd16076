"""Rotary position embeddings (RoPE), with linear, Llama-3, LongRoPE and YaRN frequency scaling.

RoPE: Su et al., "RoFormer" (arXiv:2104.09864). We use the "rotate half" layout of the Hugging
Face Llama implementation (the first and second halves of the rotated dimensions form the
rotation pairs); GGUF files store Q/K rows permuted for the interleaved layout and the loader
undoes that. With a partial rotary factor (Phi-4-mini) only the first ``rotary_dim`` dimensions
of a head turn, the rest pass through.
Scaling (``rope_type``): ``linear`` divides every frequency by ``factor``; ``llama3`` is Meta's
Llama 3.1 reference code (low frequencies divided by ``factor``, high ones kept, the band
between smoothly interpolated); ``longrope`` (Ding et al., arXiv:2402.13753; transformers'
``_compute_longrope_parameters``) divides frequency i by ``long_factor[i]`` or
``short_factor[i]`` and scales cos and sin by ``attention_factor`` (default
``sqrt(1 + ln(s) / ln(original))`` with s = positions / original). The factors are chosen once
from the table's length, the engine's max model length: long when it exceeds
``original_max_position_embeddings`` (llama.cpp chooses from its context size the same way;
transformers switches per sequence length, so below that length the two differ when the
engine chose long); ``yarn`` (Peng et al., arXiv:2309.00071; transformers'
``_compute_yarn_parameters``, gpt-oss) blends each frequency between itself (extrapolation) and
itself divided by ``factor`` (interpolation) by a linear ramp over the pair index between the
correction dimensions of ``beta_fast`` and ``beta_slow`` rotations (floored and ceiled unless
``truncate`` is false), and scales cos and sin by ``attention_factor`` (default
``0.1 ln(factor) + 1``, or the ratio of that with ``mscale`` to that with ``mscale_all_dim``),
and DeepSeek's MLA also multiplies its softmax scale by ``mscale(factor, mscale_all_dim) ** 2``
(:func:`yarn_softmax_factor`).

:class:`InterleavedRope` turns interleaved pairs ``(x_{2i}, x_{2i+1})`` instead (DeepSeek's MLA,
transformers' complex form ``apply_rotary_emb``), its cos and sin times the attention factor.

The cos/sin tables are computed once in fp32 for every position up to the context limit and
cast to the model dtype, so a step only indexes them.
"""

from __future__ import annotations

import math

import torch

from kvledger.errors import UnsupportedModelError
from kvledger.spec import ModelSpec

SCALING_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


def inverse_frequencies(rotary_dim: int, theta: float, scaling: dict | None,
                        max_positions: int | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies, shape [rotary_dim // 2], fp32; LongRoPE's factor set is
    chosen by ``max_positions`` (module docstring).

    Raises:
        UnsupportedModelError: a ``rope_type`` outside :data:`SCALING_TYPES`.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float()
                                / rotary_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    if rope_type == "longrope":
        long = (max_positions or 0) > scaling["original_max_position_embeddings"]
        factors = scaling["long_factor" if long else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32)
    if rope_type == "yarn":
        return _yarn_scaled(inv_freq, rotary_dim, theta, scaling, max_positions)
    raise UnsupportedModelError(f"rope scaling type {rope_type!r} is not supported "
                                f"(supported: {', '.join(SCALING_TYPES)})")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(scale) + 1`` (arXiv:2309.00071 Eq. 21), 1 for scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_factor(scaling: dict | None) -> float:
    """The factor on an MLA layer's softmax scale: ``mscale(factor, mscale_all_dim) ** 2`` under
    YaRN with ``mscale_all_dim`` set, else 1 (transformers' ``yarn_apply_mscale``)."""
    scaling = scaling or {}
    if scaling.get("rope_type", "default") == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2


def attention_factor(scaling: dict | None, max_positions: int) -> float:
    """The factor on cos and sin: LongRoPE's or YaRN's ``attention_factor`` (module
    docstring), else 1."""
    if (scaling or {}).get("rope_type") == "yarn":
        return _yarn_attention_factor(scaling, max_positions)
    if (scaling or {}).get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


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


def _yarn_factor(scaling: dict, max_positions: int | None) -> float:
    return float(scaling.get("factor") or (max_positions or 0)
                 / scaling["original_max_position_embeddings"])


def _yarn_attention_factor(scaling: dict, max_positions: int) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_positions)
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    return yarn_mscale(factor)


def _yarn_scaled(inv_freq: torch.Tensor, rotary_dim: int, theta: float, scaling: dict,
                 max_positions: int | None) -> torch.Tensor:
    factor = _yarn_factor(scaling, max_positions)
    original = scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the pair index turning that many times
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high += 0.001 if low == high else 0.0
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


class RotaryEmbedding:
    """Precomputed cos/sin tables, each [max_positions, rotary_dim] in the model dtype.

    ``rotary_dim``: the leading dimensions of a head that turn (default: all ``head_dim``)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, rotary_dim: int | None = None) -> None:
        self.rotary_dim = rotary_dim or head_dim
        self.inv_freq = inverse_frequencies(self.rotary_dim, theta, scaling, max_positions)
        self.dtype, self.mscale = dtype, attention_factor(scaling, max_positions)
        self._tabulate(max_positions)

    def _tabulate(self, num_positions: int) -> None:
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32,
                                         device=self.inv_freq.device), self.inv_freq)
        both, signed = torch.cat((freqs, freqs), dim=-1), torch.cat((-freqs, freqs), dim=-1)
        self.cos = (both.cos() * self.mscale).to(self.dtype)
        # sin with the first half negated: rotate_half(x) * sin == roll(x, half) * signed_sin
        self.sin = (signed.sin() * self.mscale).to(self.dtype)
        # fp32 [positions, rotary_dim / 2] for the native op (kvledger.device.cpu.fused)
        self.cos_half = (freqs.cos() * self.mscale).contiguous()
        self.sin_half = (freqs.sin() * self.mscale).contiguous()

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
        """Rotate ``x`` [tokens, heads, head_dim] by the angles of :meth:`lookup` (its first
        ``cos.shape[-1]`` dimensions; the rest pass through).

        HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``, written as
        ``x * cos + roll(x, half) * signed_sin`` (sin(-a) = -sin(a)): three ops instead of seven.
        """
        rot = cos.shape[-1]
        if rot < x.shape[-1]:
            return torch.cat((RotaryEmbedding.apply(x[..., :rot], cos, sin), x[..., rot:]), -1)
        rolled = torch.roll(x, rot // 2, dims=-1)
        return torch.addcmul(x * cos, rolled, sin)


class InterleavedRope:
    """cos / sin [positions, rope / 2] fp32 of the pairs' angles, times the attention factor."""

    def __init__(self, spec: ModelSpec) -> None:
        dim, positions = spec.latent.qk_rope_head_dim, spec.max_position_embeddings
        self.inv_freq = inverse_frequencies(dim, spec.rope.theta, spec.rope.scaling, positions)
        self.mscale = attention_factor(spec.rope.scaling, positions)
        self._tabulate(positions)

    def _tabulate(self, num_positions: int) -> None:
        angles = torch.outer(torch.arange(num_positions, dtype=torch.float32), self.inv_freq)
        self.cos, self.sin = angles.cos() * self.mscale, angles.sin() * self.mscale

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, n, rope] turned at positions [T] (a new tensor, x's dtype)."""
        if len(positions) and int(positions.max()) >= len(self.cos):
            self._tabulate(2 * (int(positions.max()) + 1))
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return turned.flatten(-2).to(x.dtype)
