"""LFM2's gated short convolution (Liquid AI; transformers' ``Lfm2ShortConv``), a state mixer
(:mod:`.state`): ``in_proj`` to B, C and x, ``y = C * conv(B * x)`` by a causal depthwise
convolution of ``kernel`` taps over each channel, ``out_proj``.

Per sequence the state is the last ``kernel - 1`` values of ``B * x`` (``state.conv``
[seqs, hidden, kernel - 1], oldest first): a chunk convolves the window carried from the
sequence's previous chunk followed by its own values, and leaves its last ``kernel - 1``
values as the window (``F.conv1d`` without padding over the concatenation). A decode-only
step is one multiply-add over the ``kernel`` values of every sequence at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvledger.model.layers.linears import held_bytes
from kvledger.model.layers.state import LayerState, StateMeta
from kvledger.model.linear import Linear


class ShortConv:
    """One layer's gated short convolution (module docstring). It takes the checkpoints the
    engine asks for: the window after ``o`` tokens of a chunk is the columns ``o .. o + k - 2``
    of the carried window followed by the chunk.

    Args:
        in_proj: the Linear to 3 x hidden (B, C, x); out_proj: hidden -> hidden.
        weight: the convolution's taps [hidden, kernel]; bias: [hidden] or None.
    """

    CHECKPOINTS = True
    """Fills ``LayerState.snapshots`` (``model/layers/state.py``)."""

    def __init__(self, in_proj: Linear, out_proj: Linear, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        self.in_proj, self.out_proj = in_proj, out_proj
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor, state: LayerState, meta: StateMeta) -> torch.Tensor:
        """[T, hidden] of normed hidden states x [T, hidden]; ``state.conv`` updated in place."""
        b, c, v = self.in_proj(x).chunk(3, dim=-1)
        bx = b * v
        if meta.decode_only and not meta.checkpoints:
            out = self._decode(bx, state.conv)
        else:
            out = torch.empty_like(bx)
            for i, (start, n) in enumerate(meta.spans()):
                wanted = meta.checkpoints[i] if meta.checkpoints else ()
                out[start:start + n] = self._chunk(bx[start:start + n], state, i, wanted)
        return self.out_proj(c * out)

    def _decode(self, bx: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """One token per sequence: ``bx`` [S, hidden] after each row's window [S, hidden, k-1]."""
        full = torch.cat([window, bx.to(window.dtype)[:, :, None]], dim=-1)  # [S, hidden, k]
        window.copy_(full[:, :, 1:])
        out = (full * self.weight).sum(-1)
        return (out if self.bias is None else out + self.bias).to(bx.dtype)

    def _chunk(self, bx: torch.Tensor, state: LayerState, i: int,
               wanted: tuple[int, ...]) -> torch.Tensor:
        """A chunk ``bx`` [n, hidden] of sequence ``i`` after its window ``state.conv[i]``;
        snapshots of the window after each offset of ``wanted``."""
        window = state.conv
        full = torch.cat([window[i], bx.to(window.dtype).T], dim=-1)  # [hidden, k - 1 + n]
        width = window.shape[2]
        for o in wanted:
            state.snapshots.append((i, o, full[:, o:o + width].clone(), None))
        window[i].copy_(full[:, full.shape[1] - width:])
        out = F.conv1d(full[None], self.weight[:, None, :], self.bias, groups=full.shape[0])
        return out[0].T.to(bx.dtype)

    def linears(self, shape_class: str) -> list[Linear]:
        """Its Linears of ``qkv`` (in_proj) or ``o`` (out_proj), the attention's classes."""
        return {"qkv": [self.in_proj], "o": [self.out_proj]}.get(shape_class, [])

    @property
    def decode_bytes(self) -> int:
        """Weight bytes one decode step reads."""
        return self.in_proj.nbytes + self.out_proj.nbytes + self.weight.nbytes

    @property
    def held_bytes(self) -> int:
        """Bytes of every tensor held."""
        extra = self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)
        return held_bytes(self.in_proj) + held_bytes(self.out_proj) + extra
