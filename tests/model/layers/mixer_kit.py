"""What the state-mixer tests share: our mixers and transformers' with the same random weights
(:func:`deltanet_pair`, :func:`qwen3_next_pair`, :func:`mamba2_pair`), transformers' outputs
over successive inputs with its own cache (:meth:`Pair.theirs_over`), and a flat step batch of
several sequences through one of ours with their state rows (:func:`step`)."""

from __future__ import annotations

import torch

from kvledger.model.layers.gated_deltanet import DeltaNetShape, GatedDeltaNet
from kvledger.model.layers.mamba2 import Mamba2, Mamba2Shape
from kvledger.model.layers.state import LayerState, StateMeta
from kvledger.model.linear import Linear

DELTANET = DeltaNetShape(hidden_size=48, num_k_heads=2, num_v_heads=4, head_k_dim=16,
                         head_v_dim=16, conv_kernel=4)
"""Grouped heads (two value heads per key head), a chunk of 64 tokens."""
MAMBA2 = Mamba2Shape(hidden_size=32, num_heads=4, head_dim=8, d_state=16, n_groups=2,
                     conv_kernel=4, chunk_size=16)
"""Two groups of two heads, a chunk of 16 tokens (the lengths tested cross several)."""


class Pair:
    """transformers' layer ``theirs`` (its ``config``) and ``ours`` with the same weights."""

    def __init__(self, config, theirs: torch.nn.Module, ours, shape) -> None:
        self.config, self.theirs, self.ours, self.shape = config, theirs, ours, shape

    def state(self, num_seqs: int) -> LayerState:
        """Rows for ``num_seqs`` sequences (fp32, as the engine keeps them), filled with
        garbage (:func:`step` zeroes a fresh sequence's)."""
        shapes = self.shape.state_shapes()
        return LayerState(conv=torch.randn(num_seqs, *shapes["conv"]),
                          recurrent=torch.randn(num_seqs, *shapes["recurrent"]))

    def theirs_over(self, chunks: list[torch.Tensor]) -> torch.Tensor:
        """transformers' outputs over successive inputs [L_i, hidden], with its cache."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        with torch.no_grad():
            return torch.cat([self.theirs(x[None], cache=cache)[0] for x in chunks])


def step(mixer, xs: list[torch.Tensor], state: LayerState, fresh: list[bool],
         checkpoints: tuple[tuple[int, ...], ...] = ()) -> list[torch.Tensor]:
    """One step of ``mixer`` over the sequences' new tokens xs[i] [L_i, hidden] laid end to end,
    sequence i in row i of ``state`` (zeroed first where ``fresh``, as the engine does), the
    state wanted after ``checkpoints[i]`` tokens of each: each sequence's output rows."""
    lengths = [x.shape[0] for x in xs]
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    for i, new in enumerate(fresh):
        if new:
            state.conv[i] = 0
            state.recurrent[i] = 0
    out = mixer.forward(torch.cat(xs), state, StateMeta(tuple(starts), tuple(lengths),
                                                        tuple(fresh), checkpoints))
    return list(out.split(lengths))


def _linear_of(w: dict[str, torch.Tensor]):
    """``(stems, shape class) -> Linear`` of the row-concatenated dense weights (popped)."""
    def linear(stems: list[str], _cls: str) -> Linear:
        bias = [w.pop(s + ".bias", None) for s in stems]
        return Linear(torch.cat([w.pop(s + ".weight") for s in stems]),
                      None if bias[0] is None else torch.cat(bias))
    return linear


def _randomize(module: torch.nn.Module, seed: int, prefix: str) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` drawn at random (seeded); the state dict under
    ``prefix``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 1 else 0.2))
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
    return {prefix + k: v.clone() for k, v in module.state_dict().items()}


def deltanet_pair(seed: int = 0, kernels=None) -> Pair:
    """transformers' ``Qwen3_5GatedDeltaNet`` and our :class:`GatedDeltaNet` at
    :data:`DELTANET`."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    s = DELTANET
    cfg = Qwen3_5TextConfig(
        hidden_size=s.hidden_size, linear_num_key_heads=s.num_k_heads,
        linear_num_value_heads=s.num_v_heads, linear_key_head_dim=s.head_k_dim,
        linear_value_head_dim=s.head_v_dim, linear_conv_kernel_dim=s.conv_kernel,
        num_hidden_layers=1, layer_types=["linear_attention"])
    theirs = Qwen3_5GatedDeltaNet(cfg, 0).eval()
    w = _randomize(theirs, seed, "model.layers.0.linear_attn.")
    ours = GatedDeltaNet.from_weights(s, w, "model.layers.0.", _linear_of(w), kernels)
    assert not w
    return Pair(cfg, theirs, ours, s)


def qwen3_next_pair(seed: int = 0, kernels=None) -> Pair:
    """transformers' ``Qwen3NextGatedDeltaNet`` (its fused ``in_proj_qkvz`` / ``in_proj_ba``)
    and our :class:`GatedDeltaNet` at :data:`DELTANET`."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    s = DELTANET
    cfg = Qwen3NextConfig(
        hidden_size=s.hidden_size, linear_num_key_heads=s.num_k_heads,
        linear_num_value_heads=s.num_v_heads, linear_key_head_dim=s.head_k_dim,
        linear_value_head_dim=s.head_v_dim, linear_conv_kernel_dim=s.conv_kernel,
        num_hidden_layers=1, layer_types=["linear_attention"])
    theirs = Qwen3NextGatedDeltaNet(cfg, 0).eval()
    w = _randomize(theirs, seed, "model.layers.0.linear_attn.")
    ours = GatedDeltaNet.from_weights(s, w, "model.layers.0.", _linear_of(w), kernels)
    assert not w
    return Pair(cfg, theirs, ours, s)


def mamba2_pair(seed: int = 0, kernels=None) -> Pair:
    """transformers' ``GraniteMoeHybridMambaLayer`` and our :class:`Mamba2` at :data:`MAMBA2`."""
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
        GraniteMoeHybridMambaLayer,
    )

    s = MAMBA2
    cfg = GraniteMoeHybridConfig(
        hidden_size=s.hidden_size, mamba_n_heads=s.num_heads, mamba_d_head=s.head_dim,
        mamba_d_state=s.d_state, mamba_n_groups=s.n_groups, mamba_d_conv=s.conv_kernel,
        mamba_expand=s.intermediate // s.hidden_size, mamba_chunk_size=s.chunk_size,
        num_hidden_layers=1, layer_types=["mamba"])
    theirs = GraniteMoeHybridMambaLayer(cfg, 0).eval()
    w = _randomize(theirs, seed, "model.layers.0.mamba.")
    ours = Mamba2.from_weights(s, w, "model.layers.0.", _linear_of(w), kernels)
    assert not w
    return Pair(cfg, theirs, ours, s)
