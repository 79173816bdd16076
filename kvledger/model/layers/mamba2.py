"""The Mamba-2 mixer (Dao & Gu, "Transformers are SSMs: Generalized Models and Efficient
Algorithms Through Structured State Space Duality", arXiv:2405.21060) as transformers'
``GraniteMoeHybridMambaLayer`` computes it (Granite-4.0-H; Bamba's and Mamba-2's own mixer
are the same).

Per token: one projection gives the gate z (``intermediate``), xBC (``conv_dim = intermediate +
2 n_groups d_state``) and dt (one per head); xBC passes a causal depthwise conv1d (kernel K,
with bias) and SiLU and splits into x [heads, head_dim], B and C [n_groups, d_state] (a group
serves ``heads / n_groups`` consecutive heads). Per head, with ``dt = softplus(dt + dt_bias)``
(clamped to ``time_step_limit``) and ``A = -exp(A_log)``, the state S [head_dim, d_state]
follows

    S <- exp(dt A) S + dt x B^T;   y = S C + D x,

and the output is ``out_proj(RMSNorm_grouped(y * silu(z)) * w)`` (the norm over each of the
n_groups slices of ``intermediate``).

A prefill runs the SSD chunked scan: within a chunk the outputs are a masked [C, C] product
(C B^T weighted by the decays between positions), each chunk's contribution to the state is one
product, and only the states at chunk boundaries pass from chunk to chunk. The decays are
differences of a cumulative sum of dt A taken in fp64 (rounded once to fp32 for the [C, C]
ones). The chunk size changes nothing but the cost: the config's ``mamba_chunk_size`` (256)
is a GPU kernel's tile; on a CPU the [C, C] decays per head outweigh the states passed between
chunks above 64 tokens (Granite-4.0-H-Micro's shapes, 512 tokens: 64 is 1.4-2x faster than
256), so the default here is 64 (``Mamba2Shape.chunk_size``). A decode token takes the
recurrent update, through the device's native step where it has one (``Kernels.state_mixers``),
else in PyTorch. Arithmetic is fp32 whatever the compute dtype; the state is kept in the slot's
dtype.

The state of a sequence: ``conv`` [conv_dim, K - 1] and ``recurrent`` [heads, head_dim,
d_state].
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

CHUNK_WORK = 1 << 24
"""Most (chunk, head, position, position) decay entries a prefill builds at once; more chunks
are computed in slices (4,096 tokens at Granite-4.0-H-Micro's shapes: 64 MiB per slice)."""


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba-2 layer's sizes (Granite's ``mamba_*`` config fields), dt limits, norm eps, and
    the tokens per chunk of a prefill's scan (the result does not depend on it)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 64
    dt_min: float = 0.0
    dt_max: float = float("inf")
    eps: float = 1e-6

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, B and C."""
        return self.intermediate + 2 * self.n_groups * self.d_state

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-sequence state: ``conv`` and ``recurrent`` shapes."""
        return {"conv": (self.conv_dim, self.conv_kernel - 1),
                "recurrent": (self.num_heads, self.head_dim, self.d_state)}


class Mamba2(ProjectedMixer):
    """One Mamba-2 layer (module docstring).

    Args:
        shape: its sizes; in_proj: [T, hidden] -> [T, intermediate + conv_dim + heads] (z, xBC,
            dt); conv_weight [conv_dim, K], conv_bias [conv_dim] or None; A_log, D, dt_bias
            [heads]; norm_weight [intermediate]; out_proj: [T, intermediate] -> [T, hidden];
        kernels: the device's (``state_mixers()``: the native decode steps, or None).
    """

    CHECKPOINTS = True
    """Fills ``LayerState.snapshots`` at the offsets of ``StateMeta.checkpoints``."""

    def __init__(self, shape: Mamba2Shape, in_proj, conv_weight: torch.Tensor,
                 conv_bias: torch.Tensor | None, A_log: torch.Tensor, D: torch.Tensor,
                 dt_bias: torch.Tensor, norm_weight: torch.Tensor, out_proj,
                 kernels=None) -> None:
        self.shape, self.in_proj, self.out_proj = shape, in_proj, out_proj
        self.conv_weight = conv_weight.float().reshape(shape.conv_dim, shape.conv_kernel)
        self.conv_bias = None if conv_bias is None else conv_bias.float().contiguous()
        self.A, self.D = -A_log.float().exp(), D.float().contiguous()
        self.dt_bias, self.norm_weight = dt_bias.float().contiguous(), norm_weight
        native = kernels.state_mixers() if kernels is not None else None
        self.native = native if native is not None and native.accepts_ssd(shape.d_state) \
            else None

    @classmethod
    def from_weights(cls, shape: Mamba2Shape, w: dict, prefix: str, linear,
                     kernels=None) -> Mamba2:
        """The layer from a checkpoint's tensors under ``{prefix}mamba.`` (popped); ``linear``:
        ``(stems, shape class) -> Linear`` (classes ``qkv`` / ``o``, :meth:`linears`)."""
        p = prefix + "mamba."
        return cls(shape, linear([p + "in_proj"], "qkv"), w.pop(p + "conv1d.weight"),
                   w.pop(p + "conv1d.bias", None), w.pop(p + "A_log"), w.pop(p + "D"),
                   w.pop(p + "dt_bias"), w.pop(p + "norm.weight"), linear([p + "out_proj"], "o"),
                   kernels)

    def _small(self) -> list[torch.Tensor]:
        extra = [] if self.conv_bias is None else [self.conv_bias]
        return [self.conv_weight, self.A, self.D, self.dt_bias, self.norm_weight, *extra]

    def forward(self, x: torch.Tensor, state: LayerState, meta: StateMeta) -> torch.Tensor:
        """[T, hidden] -> [T, hidden] for the step's flat batch; reads and updates ``state``."""
        s = self.shape
        split = StepSplit(meta)
        proj = self.in_proj(x)
        z, xbc, dt = proj.split([s.intermediate, s.conv_dim, s.num_heads], -1)
        parts, snapshots = [], Snapshots()
        if split.decode:
            seqs = split.decode
            parts.append((seqs, self._decode(split.take(xbc, seqs), split.take(dt, seqs), state,
                                             seqs)))
            snapshots.after_decode(state, split, seqs)
        if split.prefill:
            seqs = split.prefill
            mixed = causal_conv(xbc, self.conv_weight, self.conv_bias, state.conv, split, seqs,
                                snapshots)
            parts.append((seqs, self._prefill(mixed, split.take(dt, seqs), state,
                                              ChunkLayout(split, seqs, s.chunk_size), snapshots)))
        snapshots.flush(state)
        return self.out_proj(self._gated_norm(split.assemble(parts, x.shape[0]), z))

    __call__ = forward

    def _split(self, mixed: torch.Tensor, dt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [rows, heads, head_dim], B and C [rows, groups, d_state], dt [rows, heads], fp32."""
        s = self.shape
        x, B, C = mixed.float().split([s.intermediate, s.n_groups * s.d_state,
                                       s.n_groups * s.d_state], -1)
        dt = F.softplus(dt.float() + self.dt_bias).clamp(s.dt_min, s.dt_max)
        return (x.reshape(-1, s.num_heads, s.head_dim), B.reshape(-1, s.n_groups, s.d_state),
                C.reshape(-1, s.n_groups, s.d_state), dt)

    def _decode(self, xbc, dt, state: LayerState, seqs: list[int]) -> torch.Tensor:
        """One token per sequence of ``seqs``: conv update and SSM step -> y [n, heads, P]."""
        s = self.shape
        idx = torch.as_tensor(seqs, dtype=torch.long)
        if self.native is not None and self.native.takes(state.conv, state.recurrent, xbc) \
                and self.native.takes(state.conv, state.recurrent, dt):
            mixed = self.native.conv(xbc, state.conv, idx, self.conv_weight, self.conv_bias)
            return self.native.ssd(mixed, dt, state.recurrent, idx, s.n_groups, self.A, self.D,
                                   self.dt_bias, (s.dt_min, s.dt_max))
        x, B, C, dt = self._split(conv_update(xbc, self.conv_weight, self.conv_bias,
                                              state.conv, seqs), dt)
        rep = s.num_heads // s.n_groups
        B, C = B.repeat_interleave(rep, 1), C.repeat_interleave(rep, 1)
        S = state.recurrent[idx].float() * (dt * self.A).exp()[..., None, None]
        S += (dt[..., None] * x)[..., None] * B[:, :, None, :]
        state.recurrent[idx] = S.to(state.recurrent.dtype)
        return torch.einsum("nhpk,nhk->nhp", S, C) + self.D[:, None] * x

    def _prefill(self, mixed, dt, state: LayerState, layout: ChunkLayout,
                 snapshots: Snapshots) -> torch.Tensor:
        """The SSD chunked scan over the prefill sequences -> y [their tokens, heads, P]; the
        state after each chunk that ends at a checkpoint goes to ``snapshots``.

        Per chunk and group, the products over its r heads run as one matrix of r x P columns
        ([l, (r p)] and [n, (r p)] blocks; the state as [n, (r p)]); only the [l, s] decays
        need each head apart."""
        s, c, size = self.shape, layout.num_chunks, layout.chunk
        x, B, C, dt = self._split(mixed, dt)
        g, r, p = s.n_groups, s.num_heads // s.n_groups, s.head_dim
        skip = self.D[:, None] * x
        # per chunk: xdt [c, g, l, r, p]; B, C [c, g, l, n]; cum [c, g, r, l] (fp64)
        xdt = layout.pad(x * dt[..., None]).view(c, size, g, r, p).transpose(1, 2).contiguous()
        per_head = xdt.permute(0, 1, 3, 2, 4).contiguous()  # [c, g, r, l, p]
        B, C = (layout.pad(t).transpose(1, 2).contiguous() for t in (B, C))
        cum = layout.pad((dt * self.A).double()).cumsum(1).permute(0, 2, 1).unflatten(1, (g, r))
        last, cum32 = cum[..., -1:], cum.float()
        to_end = (last - cum).float().exp_().transpose(-1, -2)[..., None]  # [c, g, l, r, 1]
        states = B.transpose(-1, -2) @ (xdt * to_end).view(c, g, size, r * p)  # [c, g, n, rp]
        idx = torch.as_tensor(layout.ranked, dtype=torch.long)
        S = state.recurrent[idx].float().view(-1, g, r, p, s.d_state)
        S = S.permute(0, 1, 4, 2, 3).reshape(-1, g, s.d_state, r * p)
        start = torch.empty_like(states)
        chunk_decay = last.float().exp().transpose(-1, -2)[..., None].expand(c, g, 1, r, p)
        chunk_decay = chunk_decay.reshape(c, g, 1, r * p)
        def as_state(t: torch.Tensor) -> torch.Tensor:  # [.., g, n, (r p)] -> [.., H, P, n]
            t = t.unflatten(-1, (r, p)).movedim(-3, -1)
            return t.flatten(-4, -3).to(state.recurrent.dtype, copy=True)

        for chunks, m, marks in layout.steps():
            start[chunks] = S[:m]
            S[:m] = S[:m] * chunk_decay[chunks] + states[chunks]
            for rank, i, o in marks:
                snapshots.recurrent[i, o] = as_state(S[rank])
        state.recurrent[idx] = as_state(S)
        y = (C @ start).view(c, g, size, r, p).mul_(cum32.exp().transpose(-1, -2)[..., None])
        per_slice = max(1, CHUNK_WORK // (s.num_heads * size ** 2))
        upper = torch.ones(size, size, dtype=torch.bool).triu(1)
        for a in range(0, c, per_slice):
            sl = slice(a, a + per_slice)
            decay = cum32[sl, ..., :, None] - cum32[sl, ..., None, :]  # [c, g, r, l, s]
            decay = decay.masked_fill_(upper, float("-inf")).exp_()
            scores = decay.mul_((C[sl] @ B[sl].transpose(-1, -2))[:, :, None])
            y[sl] += (scores @ per_head[sl]).transpose(2, 3)
        return layout.unpad(y.transpose(1, 2).flatten(2, 3)) + skip

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each group's slice of y * silu(z), times the weight: [T, intermediate]."""
        s = self.shape
        gated = y.reshape(-1, s.n_groups, s.intermediate // s.n_groups) * F.silu(
            z.float().view(-1, s.n_groups, s.intermediate // s.n_groups))
        normed = F.rms_norm(gated, (s.intermediate // s.n_groups,), eps=s.eps)
        return self.norm_weight * normed.reshape(-1, s.intermediate).to(z.dtype)
