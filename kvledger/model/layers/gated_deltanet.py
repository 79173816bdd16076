"""Gated DeltaNet, the linear-attention mixer of Qwen3.5 and Qwen3-Next: Yang, Kautz &
Hatamizadeh, "Gated Delta Networks", arXiv:2412.06464, as transformers' ``Qwen3_5GatedDeltaNet``
(and ``Qwen3NextGatedDeltaNet``, the same but for its fused projections) computes it.

Per token: one projection gives q, k, v (``key_dim``, ``key_dim``, ``value_dim``), the output
gate z (``value_dim``) and per value head b and a; q, k, v pass a causal depthwise conv1d
(kernel K, no bias) and SiLU; q and k are L2-normed per head and q scaled by 1/sqrt(dk); then
per value head (a q / k head serves ``num_v_heads / num_k_heads`` consecutive value heads),
with ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)``, the state
S [dk, dv] follows the gated delta rule

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q,

and the output is ``out_proj(RMSNorm(o) * w * silu(z))`` (the norm per value head).

A prefill computes the rule chunk by chunk in the WY / UT form (Yang et al., "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length", arXiv:2406.06484): within a
chunk of C tokens one triangular solve turns the C rank-one updates into two matrices
(u: the new values, w: the decayed keys that read the previous state), so a chunk costs a few
[C, C] / [C, d] matmuls and the state passes chunk to chunk. A decode token takes the
recurrent update, through the device's native step where it has one
(``Kernels.state_mixers``), else in PyTorch. Arithmetic is fp32 whatever the compute dtype;
the state is kept in the slot's dtype.

The state of a sequence: ``conv`` [conv_dim, K - 1] (the last K - 1 inputs of the conv) and
``recurrent`` [num_v_heads, dk, dv].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvledger.model.layers.state import LayerState, StateMeta
from kvledger.model.layers.state_batch import (
    ChunkLayout,
    ProjectedMixer,
    Snapshots,
    StepSplit,
    causal_conv,
    conv_update,
)

CHUNK = 64
"""Tokens per chunk of a prefill (transformers' and FLA's default)."""


@dataclass(frozen=True)
class DeltaNetShape:
    """A gated-DeltaNet layer's sizes (Qwen3.5's ``linear_*`` config fields) and norm eps."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int = 4
    eps: float = 1e-6

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-sequence state: ``conv`` and ``recurrent`` shapes."""
        return {"conv": (self.conv_dim, self.conv_kernel - 1),
                "recurrent": (self.num_v_heads, self.head_k_dim, self.head_v_dim)}


IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
"""The projections under ``linear_attn.`` fused by rows into one in this order."""


def split_qwen3_next(w: dict, p: str, shape: DeltaNetShape) -> None:
    """Qwen3-Next's ``{p}in_proj_qkvz`` and ``{p}in_proj_ba`` (rows grouped per key head: its
    q, k, then the v and z of its value heads; its value heads' b, then a) rewritten in place
    as Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``."""
    s, rep = shape, shape.num_v_heads // shape.num_k_heads
    qkvz = w.pop(p + "in_proj_qkvz.weight")
    q, k, v, z = qkvz.view(s.num_k_heads, -1, qkvz.shape[-1]).split(
        [s.head_k_dim, s.head_k_dim, rep * s.head_v_dim, rep * s.head_v_dim], 1)
    ba = w.pop(p + "in_proj_ba.weight")
    b, a = ba.view(s.num_k_heads, 2 * rep, -1).split([rep, rep], 1)
    rows = [t.reshape(-1, qkvz.shape[-1]) for t in (q, k, v)]
    w[p + "in_proj_qkv.weight"] = torch.cat(rows)
    for name, t in (("in_proj_z", z), ("in_proj_b", b), ("in_proj_a", a)):
        w[p + name + ".weight"] = t.reshape(-1, qkvz.shape[-1]).contiguous()


def l2_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(ProjectedMixer):
    """One gated-DeltaNet layer (module docstring).

    Args:
        shape: its sizes; in_proj: [T, hidden] -> [T, conv_dim + value_dim + 2 num_v_heads]
            (q, k, v, z, b, a); conv_weight [conv_dim, K]; A_log, dt_bias [num_v_heads];
            norm_weight [head_v_dim]; out_proj: [T, value_dim] -> [T, hidden];
        kernels: the device's (``state_mixers()``: the native decode steps, or None).
    """

    CHECKPOINTS = True
    """Fills ``LayerState.snapshots`` at the offsets of ``StateMeta.checkpoints``."""

    def __init__(self, shape: DeltaNetShape, in_proj, conv_weight: torch.Tensor,
                 A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor,
                 out_proj, kernels=None) -> None:
        self.shape, self.in_proj, self.out_proj = shape, in_proj, out_proj
        self.conv_weight = conv_weight.float().reshape(shape.conv_dim, shape.conv_kernel)
        self.neg_A = -A_log.float().exp()
        self.dt_bias, self.norm_weight = dt_bias.float().contiguous(), norm_weight
        self.norm_weight_f32 = norm_weight.float().contiguous()
        native = kernels.state_mixers() if kernels is not None else None
        self.native = native if native is not None and native.accepts_delta(
            shape.head_k_dim, shape.head_v_dim) else None

    @classmethod
    def from_weights(cls, shape: DeltaNetShape, w: dict, prefix: str, linear,
                     kernels=None) -> GatedDeltaNet:
        """The layer from a checkpoint's tensors under ``{prefix}linear_attn.`` (popped), in
        Qwen3.5's names or Qwen3-Next's fused ``in_proj_qkvz`` / ``in_proj_ba``
        (:func:`split_qwen3_next`); ``linear``: ``(stems, shape class) -> Linear`` of the
        row-concatenated projections (classes ``qkv`` / ``o``, :meth:`linears`)."""
        p = prefix + "linear_attn."
        if p + "in_proj_qkvz.weight" in w:
            split_qwen3_next(w, p, shape)
        return cls(shape, linear([p + n for n in IN_PROJ], "qkv"),
                   w.pop(p + "conv1d.weight"), w.pop(p + "A_log"), w.pop(p + "dt_bias"),
                   w.pop(p + "norm.weight"), linear([p + "out_proj"], "o"), kernels)

    def _small(self) -> list[torch.Tensor]:
        return [self.conv_weight, self.neg_A, self.dt_bias, self.norm_weight]

    def forward(self, x: torch.Tensor, state: LayerState, meta: StateMeta) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] for the step's flat batch; reads and updates ``state``."""
        s = self.shape
        split = StepSplit(meta)
        proj = self.in_proj(x)
        qkv, z, b, a = proj.split([s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads], -1)
        parts, snapshots = [], Snapshots()
        if split.decode:
            seqs = split.decode
            parts.append((seqs, self._decode(*(split.take(t, seqs) for t in (qkv, a, b, z)),
                                             state, seqs)))
            snapshots.after_decode(state, split, seqs)
        if split.prefill:
            seqs = split.prefill
            mixed = causal_conv(qkv, self.conv_weight, None, state.conv, split, seqs, snapshots)
            core = self._prefill(mixed, split.take(a, seqs), split.take(b, seqs), state,
                                 ChunkLayout(split, seqs, CHUNK), snapshots)
            parts.append((seqs, self._gated_norm(core, split.take(z, seqs))))
        snapshots.flush(state)
        return self.out_proj(split.assemble(parts, x.shape[0]))

    __call__ = forward

    def _gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta) [rows, num_v_heads], fp32."""
        g = self.neg_A * F.softplus(a.float() + self.dt_bias)
        return g, b.float().sigmoid()

    def _qkv(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (normed, scaled), k (normed), both per value head, and v, fp32: [rows, Hv, d]."""
        s = self.shape
        q, k, v = mixed.float().split([s.key_dim, s.key_dim, s.value_dim], -1)
        q, k = (l2_normed(t.reshape(-1, s.num_k_heads, s.head_k_dim)) for t in (q, k))
        q = q * s.head_k_dim ** -0.5
        rep = s.num_v_heads // s.num_k_heads
        if rep > 1:
            q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
        return q, k, v.reshape(-1, s.num_v_heads, s.head_v_dim)

    def _decode(self, qkv, a, b, z, state: LayerState, seqs: list[int]) -> torch.Tensor:
        """One token per sequence of ``seqs``: conv update, recurrent update and the gated
        norm -> [n, value_dim]."""
        idx = torch.as_tensor(seqs, dtype=torch.long)
        if self.native is not None and self.native.takes(state.conv, state.recurrent, a, b, z) \
                and self.native.takes(state.conv, state.recurrent, qkv):
            mixed = self.native.conv(qkv, state.conv, idx, self.conv_weight, None)
            return self.native.delta(mixed, a, b, state.recurrent, idx, self.shape.num_k_heads,
                                     self.neg_A, self.dt_bias,
                                     (z, self.norm_weight_f32, self.shape.eps))
        q, k, v = self._qkv(conv_update(qkv, self.conv_weight, None, state.conv, seqs))
        g, beta = self._gates(a, b)
        S = state.recurrent[idx].float() * g.exp()[..., None, None]
        delta = (v - torch.einsum("nhk,nhkv->nhv", k, S)) * beta[..., None]
        S += k[..., None] * delta[..., None, :]
        state.recurrent[idx] = S.to(state.recurrent.dtype)
        return self._gated_norm(torch.einsum("nhk,nhkv->nhv", q, S), z)

    def _prefill(self, mixed, a, b, state: LayerState, layout: ChunkLayout,
                 snapshots: Snapshots) -> torch.Tensor:
        """The chunked form over the prefill sequences -> o [their tokens, Hv, dv]; the state
        after each chunk that ends at a checkpoint goes to ``snapshots``."""
        s, n, size = self.shape, layout.num_chunks, layout.chunk
        g, beta = (layout.pad(t).transpose(1, 2) for t in self._gates(a, b))  # [n, H, C]
        # padded positions: q = k = v = 0 (the L2 norm of 0 is 0) and g = 0
        q, k, v = (t.view(n, size, s.num_v_heads, -1).transpose(1, 2).contiguous()
                   for t in self._qkv(layout.pad(mixed).view(n * size, -1)))
        cum = g.cumsum(-1)
        causal = torch.ones(size, size, dtype=torch.bool).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill_(~causal, float("-inf"))
        decay = decay.exp_()
        k_beta = k * beta[..., None]
        # (I + strictly lower (beta k k^T . decay)) [u | w] = [beta v | beta k exp(cum)]
        system = (k_beta @ k.transpose(-1, -2)).mul_(decay).tril_(-1)
        system.diagonal(dim1=-2, dim2=-1).fill_(1)
        rhs = torch.cat([v.mul_(beta[..., None]), k_beta.mul_(cum.exp()[..., None])], -1)
        eye = torch.eye(size).expand_as(system)  # the inverse, then one product: 1.5x faster
        inverse = torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)
        u, w = (inverse @ rhs).split([s.head_v_dim, s.head_k_dim], -1)
        attn = (q @ k.transpose(-1, -2)).mul_(decay)
        q_read = q.mul_(cum.exp()[..., None])
        k_write = k.mul_((cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)
        chunk_decay = cum[..., -1].exp()[..., None, None]
        idx = torch.as_tensor(layout.ranked, dtype=torch.long)
        S = state.recurrent[idx].float()
        out = torch.empty(n, s.num_v_heads, size, s.head_v_dim)
        for chunks, m, marks in layout.steps():
            before = S[:m]
            v_new = u[chunks] - w[chunks] @ before
            out[chunks] = q_read[chunks] @ before + attn[chunks] @ v_new
            S[:m] = before * chunk_decay[chunks] + k_write[chunks] @ v_new
            for r, i, o in marks:
                snapshots.recurrent[i, o] = S[r].to(state.recurrent.dtype, copy=True)
        state.recurrent[idx] = S.to(state.recurrent.dtype)
        return layout.unpad(out.transpose(1, 2))

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each value head's o, times the weight and silu(z): [T, value_dim]."""
        s = self.shape
        normed = F.rms_norm(core, (s.head_v_dim,), eps=s.eps).to(z.dtype)
        gated = (self.norm_weight * normed).float() * F.silu(
            z.float().view(-1, s.num_v_heads, s.head_v_dim))
        return gated.to(z.dtype).reshape(-1, s.value_dim)
