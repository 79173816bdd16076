"""How one layer's attention departs from ``softmax(q . K^T / sqrt(D)) V`` over the whole causal
context: its score scale, its sliding window, its logit soft-capping and its sink logits.

- ``scale``: the factor of q . k (``ModelSpec.attention_scale``; Gemma's
  ``query_pre_attn_scalar ** -0.5``);
- ``window``: W of a sliding layer: the query at position i sees the key at position j when
  ``i - W < j <= i`` (Beltagy et al., "Longformer", arXiv:2004.05150; the mask of transformers'
  ``sliding_window_overlay``); None for full attention;
- ``softcap``: scores become ``c * tanh(s / c)`` before the softmax (Gemma 2,
  arXiv:2408.00118 §2), None for none;
- ``sinks``: one learned logit per query head [heads] (fp32) that joins each query's softmax
  denominator and holds no value: ``out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink))``
  (gpt-oss; transformers' ``GptOssAttention``); None for none. Not the ``sinks`` retention
  policy, which keeps the first tokens' KV.

A model gives its backend one per layer (:meth:`AttentionBackend.set_layers`; the sinks are
weights, set by the model that loads them); the window is model metadata
(``ModelSpec.layers.windows``) over the ordinary full pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvledger.spec import ModelSpec


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention parameters (see the module docstring)."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = field(default=None, compare=False)

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor | None:
        """Bool [Q, K], True where the window lets query position ``query_pos[q]`` see key
        position ``key_pos[k]`` (causality not included); None when there is no window."""
        if self.window is None:
            return None
        return key_pos[None, :] > query_pos[:, None] - self.window


def layers_of(spec: ModelSpec) -> tuple[LayerAttention, ...]:
    """The per-layer attention parameters of ``spec`` (scale, ``layer_windows``, soft-cap)."""
    return tuple(LayerAttention(spec.attention_scale, window, spec.attention.logit_softcapping)
                 for window in spec.layers.windows)
