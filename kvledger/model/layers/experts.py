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

When every expert is ``w8a8``, the experts given fewer rows than their GEMM threshold (all of
them in decode) run as one grouped native product for gate_up and one for down
(``kvl_w8a8_mm_grouped``: one activation quantization, one thread team); the others one
product each. A token's k terms are summed in fp32.

DeepSeekMoE's routing (:class:`GroupRoutedExperts`; arXiv:2405.04434 §2.2, transformers'
``DeepseekV2TopkRouter`` / ``DeepseekV2Moe``): router probabilities ``p = softmax(W_r x)`` in
fp32 over all routed experts; ``greedy`` takes the top ``num_experts_per_tok``;
``group_limited_greedy`` first keeps the ``topk_group`` groups (of ``n_group`` equal groups of
experts) with the highest maximum p and takes the top-k among their experts; the chosen
weights are never renormalised and are multiplied by ``routed_scaling_factor``. Its shared
experts, one gated MLP of ``num_shared_experts x moe_intermediate_size``, are added for every
token (``shared``, either class).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvledger.model.layers.linears import held_bytes
from kvledger.model.layers.mlp import GatedMLP
from kvledger.model.linear import Linear


def grouped(linears: list[Linear]):
    """The grouped native product of ``linears`` (:meth:`kvledger.device.cpu.w8a8.W8A8Kernel.
    bind_grouped`, of the kernels they were built with) when every one is ``w8a8``, else
    None."""
    if any(lin.format != "w8a8" for lin in linears):
        return None
    return linears[0].kernels.w8a8().bind_grouped([lin._native for lin in linears])


class Experts:
    """Router and experts of one MoE layer.

    Args:
        router: ``[experts, hidden]`` Linear (dense, compute dtype).
        gate_up: per expert, the Linear of its gate rows then its up rows, ``[2f, hidden]``.
        down: per expert, ``[hidden, f]``.
        top_k: experts per token; normalize: renormalise the top-k weights (``norm_topk_prob``).
        act: ``[T, 2f] -> [T, f]``, the gated activation (SiLU x up).
        shared: the shared experts (DeepSeek's, one MLP of them all), added for every token.
    """

    def __init__(self, router: Linear, gate_up: list[Linear], down: list[Linear], top_k: int,
                 normalize: bool, act: Callable[[torch.Tensor], torch.Tensor],
                 shared: GatedMLP | None = None) -> None:
        self.router, self.gate_up, self.down = router, gate_up, down
        self.top_k, self.normalize, self.act, self.shared = top_k, normalize, act, shared
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
        """The MoE output [T, hidden] of x [T, hidden] (module docstring): each token's k terms
        summed in fp32 and rounded once to x's dtype, plus the shared experts' output."""
        _, weights, chosen = self.route(x)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        experts, rows = flat[order], order // self.top_k
        scale = weights.flatten()[order][:, None]
        used, counts = torch.unique_consecutive(experts, return_counts=True)
        out = torch.zeros(x.shape, dtype=torch.float32)
        few = counts < self._gemm_rows() if None not in self._grouped else counts < 0
        if bool(few.all()):
            self._grouped_add(out, x, experts, rows, scale, used, counts)
        elif bool(few.any()):
            pick = torch.repeat_interleave(few, counts)
            self._grouped_add(out, x, experts[pick], rows[pick], scale[pick], used[few],
                              counts[few])
        if not bool(few.all()):
            start = 0
            for e, n, grouped_ in zip(used.tolist(), counts.tolist(), few.tolist()):
                if not grouped_:
                    idx = rows[start:start + n]
                    y = self.down[e](self.act(self.gate_up[e](x[idx])))
                    out.index_add_(0, idx, y.float() * scale[start:start + n])
                start += n
        self.bytes_read += self.router.nbytes + len(used) * self.expert_bytes
        return out.to(x.dtype) if self.shared is None else out.to(x.dtype) + self.shared(x)

    def _gemm_rows(self) -> float:
        """Rows from which an expert's products run as a GEMM (:meth:`Linear.use_gemm`)."""
        rows = [lin.gemm_rows for lin in (self.gate_up[0], self.down[0])]
        return min((r for r in rows if r is not None), default=float("inf"))

    def _grouped_add(self, out: torch.Tensor, x: torch.Tensor, experts: torch.Tensor,
                     rows: torch.Tensor, scale: torch.Tensor, used: torch.Tensor,
                     counts: torch.Tensor) -> None:
        """Adds to ``out`` [T, hidden] fp32 the terms of the (token, expert) pairs sorted by
        expert (``experts``, their tokens ``rows``, weights ``scale`` [pairs, 1]; ``used`` the
        distinct experts, ``counts`` their pairs) by the grouped native products."""
        starts = torch.zeros(len(used) + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=starts[1:])
        h = self._grouped[0](x[rows], used, starts)
        if self._biases[0] is not None:
            h = h + self._biases[0][experts]
        y = self._grouped[1](self.act(h), used, starts)
        if self._biases[1] is not None:
            y = y + self._biases[1][experts]
        out.index_add_(0, rows, y.float() * scale)

    def linears(self, shape_class: str) -> list[Linear]:
        """The experts' Linears of ``gate_up`` or ``down``, then the shared experts' (``[]`` for
        another class)."""
        shared = [] if self.shared is None else self.shared.linears(shape_class)
        return {"gate_up": self.gate_up, "down": self.down}.get(shape_class, []) + shared

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (every expert is the same shape and format)."""
        return self.gate_up[0].nbytes + self.down[0].nbytes

    @property
    def decode_bytes(self) -> int:
        """Weight bytes one batch-1 decode step reads: the router, ``top_k`` experts and the
        shared experts (a larger batch reads the distinct experts its tokens chose:
        :attr:`bytes_read`)."""
        shared = 0 if self.shared is None else self.shared.decode_bytes
        return self.router.nbytes + self.top_k * self.expert_bytes + shared

    @property
    def held_bytes(self) -> int:
        """Bytes of every tensor held: the router and every expert (biases included), the
        shared experts."""
        shared = 0 if self.shared is None else self.shared.held_bytes
        return sum(held_bytes(lin) for lin in [self.router, *self.gate_up, *self.down]) + shared


class GroupRoutedExperts(Experts):
    """:class:`Experts` routed as DeepSeekMoE (module docstring)."""

    def __init__(self, *args, n_group: int, topk_group: int, scale: float,
                 shared: GatedMLP | None = None) -> None:
        super().__init__(*args, shared=shared)
        self.n_group, self.topk_group, self.scale = n_group, topk_group, scale

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        scores = probs
        if self.n_group > 1:
            groups = probs.view(len(probs), self.n_group, -1)
            keep = torch.zeros(groups.shape[:2], dtype=torch.bool)
            keep.scatter_(1, groups.amax(-1).topk(self.topk_group, dim=-1).indices, True)
            scores = (groups * keep[..., None]).view_as(probs)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        return probs, weights * self.scale, chosen
