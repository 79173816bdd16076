"""The element-wise ops of a decoder layer between its matmuls, in PyTorch: the formulas every
device's fused ops compute, their fallback, and the oracle of their tests.

- :meth:`TorchOps.add_rms_norm`: the residual add and the next RMSNorm (Zhang & Sennrich,
  arXiv:1910.07467): ``h += delta; y = h / sqrt(mean(h^2) + eps) * weight``;
- :meth:`TorchOps.rope_`: RoPE on Q and K, "rotate half" layout (Su et al., arXiv:2104.09864);
- :meth:`TorchOps.silu_mul`: ``silu(gate) * up`` (SwiGLU);
- :meth:`TorchOps.gelu_tanh_mul`: ``gelu_tanh(gate) * up`` (GeGLU with the tanh approximation
  of GELU, Hendrycks & Gimpel arXiv:1606.08415; Gemma's ``gelu_pytorch_tanh``);
- :meth:`TorchOps.clamped_swiglu`: gpt-oss's ``(clamp(up, -l, l) + 1) * g * sigmoid(a g)`` with
  ``g = min(gate, l)`` (transformers' ``GptOssExperts._apply_gate``).

A device's ops (``Kernels.fused_ops``, e.g. :class:`kvledger.device.cpu.fused.NativeOps`)
subclass :class:`TorchOps` and fall back to it for what they do not take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    """The ops in PyTorch: the reference every device's fused ops are tested against."""

    name = "torch"

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its RMSNorm) for h, delta [T, dim] and weight [dim] (h's dtype, or fp32:
        then the norm is computed in fp32 and rounded once to h's dtype)."""
        if delta is not None:
            h = h + delta
        if weight.dtype != h.dtype:
            return h, F.rms_norm(h.float(), (h.shape[-1],), weight.float(), eps=eps).to(h.dtype)
        return h, F.rms_norm(h, (h.shape[-1],), weight, eps=eps)

    def rope_(self, qk: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
        """qk [T, heads, D] rotated by the angles of ``positions`` [T] (a RotaryEmbedding)."""
        cos, sin = rope.lookup(positions)
        return rope.apply(qk, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2f] -> [T, f]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) * up for gate_up [T, 2f] -> [T, f]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's clamped SwiGLU of gate_up [T, 2f] (gate columns, then up) -> [T, f]:
        ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))
