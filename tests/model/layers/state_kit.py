"""What the state-mixer tests share: a flat step batch of several sequences through one of our
mixers with their state slots, and the random weights of transformers' module as our layer's."""

from __future__ import annotations

import torch

from kvledger.model.layers.state import LayerState, StateMeta
from kvledger.model.linear import Linear


def new_state(shapes: dict[str, tuple[int, ...]], num_seqs: int,
              dtype: torch.dtype = torch.float32) -> LayerState:
    """Slots for ``num_seqs`` sequences, filled with garbage (a fresh sequence must not read
    it)."""
    return LayerState(conv=torch.randn(num_seqs, *shapes["conv"]).to(dtype),
                      recurrent=torch.randn(num_seqs, *shapes["recurrent"]).to(dtype))


def step(mixer, xs: list[torch.Tensor], state: LayerState, fresh: list[bool]
         ) -> list[torch.Tensor]:
    """One step of ``mixer`` over the sequences' new tokens xs[i] [L_i, hidden] laid end to end,
    sequence i in slot i of ``state``: each sequence's output rows."""
    lengths = [x.shape[0] for x in xs]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    out = mixer.forward(torch.cat(xs), state, StateMeta(cu, torch.tensor(fresh)))
    return list(out.split(lengths))


def linear_of(w: dict[str, torch.Tensor]):
    """``(stems, shape class) -> Linear`` of the row-concatenated dense weights (popped)."""
    def linear(stems: list[str], _cls: str) -> Linear:
        bias = [w.pop(s + ".bias", None) for s in stems]
        return Linear(torch.cat([w.pop(s + ".weight") for s in stems]),
                      None if bias[0] is None else torch.cat(bias))
    return linear


def randomize(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` drawn at random (seeded), returned as a state dict."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 1 else 0.2))
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 1)
    return dict(module.state_dict())
