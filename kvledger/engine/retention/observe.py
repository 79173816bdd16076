"""Attention observed for heavy-hitter (h2o) and SnapKV scores.

An :class:`AttentionObserver` rides along one sequence's chunk in a step
(``AttentionMetadata.observers``); the attention backend calls :meth:`observe` once per layer
after writing the new K/V. It recomputes the chunk's attention probabilities over the context
the chunk attends (softmax(q . k / sqrt(D)) under the same mask) and adds them, summed over the
scored queries, to a score per context key: the accumulated attention of H2O
(arXiv:2306.14048) and the observation-window votes of SnapKV (arXiv:2404.14469).

Per-head selection keeps a score per (layer, KV head, key): the query heads of a KV head's GQA
group are summed, as kvpress's SnapKV press averages them (the ranking is the same) and as
SnapKV's own code does for grouped heads. Per-sequence selection sums layers and all heads into
one score per key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvledger.engine.kv.store import KVStore


@dataclass
class AttentionObserver:
    """Scores of one chunk's context keys.

    Attributes:
        rows: the chunk's query rows in the step's flat batch.
        slots: [c] slots of the keys the chunk attends.
        mask: [n, c] bool, which key each of the n queries sees.
        scored: [n] bool, the queries whose attention counts.
        heads: (layers, kv_heads) for per-head scores; None: per sequence.
        scores: [c] fp32 accumulated attention, or [layers * kv_heads, c] per head (row
            ``layer * kv_heads + head``), filled during the forward pass.
    """

    rows: slice
    slots: torch.Tensor
    mask: torch.Tensor
    scored: torch.Tensor
    heads: tuple[int, int] | None = None
    scores: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        rows = () if self.heads is None else (self.heads[0] * self.heads[1],)
        self.scores = torch.zeros(*rows, len(self.slots))

    def observe(self, layer: int, q: torch.Tensor, store: KVStore) -> None:
        """Add layer ``layer``'s attention of the scored queries (q: [T, heads, D], the step's
        queries) to ``scores``."""
        qs = q[self.rows][self.scored].float()
        if len(qs) == 0:
            return
        keys = store.gather(layer, self.slots)[0].float()  # [c, kv_heads, D]
        m, heads, dim = qs.shape
        kv_heads = keys.shape[1]
        qg = qs.view(m, kv_heads, heads // kv_heads, dim)
        logits = torch.einsum("mkgd,ckd->mkgc", qg, keys) / math.sqrt(dim)
        logits = logits.masked_fill(~self.mask[self.scored][:, None, None, :], -math.inf)
        probs = logits.softmax(-1)
        if self.heads is None:
            self.scores += probs.sum((0, 1, 2))
        else:
            self.scores[layer * kv_heads: (layer + 1) * kv_heads] += probs.sum((0, 2))
