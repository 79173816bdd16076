"""The gated MLP: ``down(act(gate x) * up x)`` with gate and up fused into one Linear (gate rows,
then up), act SiLU (SwiGLU; Shazeer, arXiv:2002.05202) or tanh-approximated GELU (GeGLU,
Gemma's ``gelu_pytorch_tanh``), given as ``[T, 2f] -> [T, f]`` of the fused product (the
device's fused op, ``kvledger.device.ops``).

:class:`SigmoidGatedMLP` is the gated MLP scaled per token by ``sigmoid(g . x)``, a learned
gate of one row: the Qwen-MoE shared expert (``shared_expert_gate``; transformers'
``Qwen3_5MoeSparseMoeBlock``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvledger.model.layers.linears import held_bytes
from kvledger.model.linear import Linear


class GatedMLP:
    """One gated MLP (module docstring): ``gate_up`` [2f, hidden], ``down`` [hidden, f]."""

    def __init__(self, gate_up: Linear, down: Linear,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.gate_up, self.down, self.act = gate_up, down, act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        return self.down(self.act(self.gate_up(x)))

    def linears(self, shape_class: str) -> list[Linear]:
        """Its Linears of ``gate_up`` or ``down`` (``[]`` for another class)."""
        return {"gate_up": [self.gate_up], "down": [self.down]}.get(shape_class, [])

    @property
    def decode_bytes(self) -> int:
        """Weight bytes one decode step reads: both Linears, whole."""
        return self.gate_up.nbytes + self.down.nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes of every tensor held (biases included)."""
        return held_bytes(self.gate_up) + held_bytes(self.down)


class SigmoidGatedMLP(GatedMLP):
    """:class:`GatedMLP` times ``sigmoid(gate x)`` (module docstring); ``gate`` [1, hidden]."""

    def __init__(self, gate_up: Linear, down: Linear,
                 act: Callable[[torch.Tensor], torch.Tensor], gate: Linear) -> None:
        super().__init__(gate_up, down, act)
        self.gate = gate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * super().__call__(x)

    @property
    def decode_bytes(self) -> int:
        return super().decode_bytes + self.gate.nbytes

    @property
    def held_bytes(self) -> int:
        return super().held_bytes + held_bytes(self.gate)
