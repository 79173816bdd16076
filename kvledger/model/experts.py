"""A layer's routed experts: top-k routing and the experts' SwiGLU MLPs computed grouped by
expert (Shazeer et al., "Outrageously Large Neural Networks", arXiv:1701.06538; Mixtral,
arXiv:2401.04088 §2; transformers' ``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``).

Routing, per token ``x`` [hidden]: router logits ``l = W_r x`` [experts], ``p = softmax(l)`` in
fp32, the ``k`` largest ``p`` chosen; with ``norm_topk_prob`` (Mixtral always, Qwen3-MoE per its
config) their weights are renormalised to sum 1, which is the softmax over the chosen ``k``
logits. The layer's output is ``sum_i p_i * down_i(silu(gate_i x) * up_i x)`` over the chosen
experts.

Grouped by expert: the T x k (token, expert) pairs are sorted by expert (a stable sort), so each
expert that some token chose runs one matmul over all of its tokens' rows, and an expert no
token chose is never read; the loop is over experts (at most ``experts``), never over tokens.
Each expert's weights are :class:`~kvledger.model.linear.Linear` in the format the device chose
for the ``gate_up`` / ``down`` shape classes (the kernel probe times them at the expert's shape,
``kernel_probe.shapes``). :attr:`Experts.bytes_read` counts the weight bytes each call reads
(router and chosen experts), the figure checked against the ledger's active parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvledger.model.linear import Linear


class Experts:
    """Router and experts of one MoE layer.

    Args:
        router: ``[experts, hidden]`` Linear (dense, compute dtype).
        gate_up: per expert, the Linear of its gate rows then its up rows, ``[2f, hidden]``.
        down: per expert, ``[hidden, f]``.
        top_k: experts per token; normalize: renormalise the top-k weights (``norm_topk_prob``).
        act: ``[T, 2f] -> [T, f]``, the gated activation (SiLU x up).
    """

    def __init__(self, router: Linear, gate_up: list[Linear], down: list[Linear], top_k: int,
                 normalize: bool, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.router, self.gate_up, self.down = router, gate_up, down
        self.top_k, self.normalize, self.act = top_k, normalize, act
        self.bytes_read = 0
        """Weight bytes read by every call so far (router + the experts run)."""

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router probabilities [T, experts] fp32, weights [T, k] fp32, chosen experts [T, k])
        of hidden states x [T, hidden]."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, chosen

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE output [T, hidden] of x [T, hidden] (module docstring)."""
        _, weights, chosen = self.route(x)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k
        scale = weights.flatten()[order][:, None]
        counts = torch.bincount(flat, minlength=len(self.down)).tolist()
        out = torch.zeros_like(x)
        read, start = self.router.nbytes, 0
        for e, n in enumerate(counts):
            if n:
                idx = rows[start:start + n]
                y = self.down[e](self.act(self.gate_up[e](x[idx])))
                out.index_add_(0, idx, (y * scale[start:start + n]).to(x.dtype))
                read += self.gate_up[e].nbytes + self.down[e].nbytes
            start += n
        self.bytes_read += read
        return out

    def linears(self, shape_class: str) -> list[Linear]:
        """The experts' Linears of ``gate_up`` or ``down`` (``[]`` for another class)."""
        return {"gate_up": self.gate_up, "down": self.down}.get(shape_class, [])

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (every expert is the same shape and format)."""
        return self.gate_up[0].nbytes + self.down[0].nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the router and every expert."""
        return self.router.nbytes + sum(lin.nbytes for lin in self.gate_up + self.down)
