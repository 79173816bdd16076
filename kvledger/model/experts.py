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

When every expert is ``w8a8`` and the call has fewer rows than the experts' GEMM threshold
(decode), each of gate_up and down is one grouped native product over all chosen experts
(``kvl_w8a8_mm_grouped``: one activation quantization, one thread team) and a token's k terms
are summed in fp32; otherwise one product per chosen expert, summed in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvledger.device.cpu.kernels import KERNELS
from kvledger.model.linear import Linear


def grouped(linears: list[Linear]):
    """The grouped native product of ``linears`` (:meth:`kvledger.device.cpu.w8a8.W8A8Kernel.
    bind_grouped`) when every one is ``w8a8``, else None."""
    if any(lin.format != "w8a8" for lin in linears):
        return None
    return KERNELS.w8a8().bind_grouped([lin._native for lin in linears])


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
        self._grouped = grouped(gate_up), grouped(down)
        self._biases = [None if lin[0].bias is None else torch.stack([e.bias for e in lin])
                        for lin in (gate_up, down)]

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
        if None not in self._grouped and x.shape[0] < min(
                lin.gemm_rows or x.shape[0] + 1 for lin in (self.gate_up[0], self.down[0])):
            return self._grouped_call(x, flat[order], rows, scale)
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

    def _grouped_call(self, x: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor,
                      scale: torch.Tensor) -> torch.Tensor:
        """__call__ by the grouped native products: ``experts`` [T k] of the (token, expert)
        pairs sorted by expert, ``rows`` their tokens, ``scale`` [T k, 1] their weights; the k
        terms of a token are summed in fp32, in expert order, and rounded once."""
        used, counts = torch.unique_consecutive(experts, return_counts=True)
        starts = torch.zeros(len(used) + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=starts[1:])
        h = self._grouped[0](x[rows], used, starts)
        if self._biases[0] is not None:
            h = h + self._biases[0][experts]
        y = self._grouped[1](self.act(h), used, starts)
        if self._biases[1] is not None:
            y = y + self._biases[1][experts]
        out = torch.zeros(x.shape, dtype=torch.float32).index_add_(0, rows, y.float() * scale)
        self.bytes_read += self.router.nbytes + len(used) * self.expert_bytes
        return out.to(x.dtype)

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
