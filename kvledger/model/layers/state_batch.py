"""The flat token batch of a step as the state mixers (:mod:`.gated_deltanet`, :mod:`.mamba2`)
read it: which sequences decode one token and which prefill several (:class:`StepSplit`), the
causal depthwise convolution over each sequence's tokens after its conv window
(:func:`causal_conv`; one token: :func:`conv_update`), and the prefill tokens laid out as padded chunks per sequence for a
chunked scan (:class:`ChunkLayout`).

A step's sequences are spans of the batch (:class:`kvledger.model.layers.state.StateMeta`),
each with its row of the :class:`kvledger.model.layers.state.LayerState` (same order; a fresh
sequence's rows come zeroed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvledger.model.layers.state import StateMeta


class StepSplit:
    """The step's sequences by how the mixers compute them: ``decode`` (one token: the
    recurrent update) and ``prefill`` (more: the chunked form), each a list of sequence
    indices, with every sequence's ``starts`` and ``lengths`` in the flat batch."""

    def __init__(self, meta: StateMeta) -> None:
        self.starts, self.lengths = list(meta.starts), list(meta.lengths)
        self.decode = [i for i, n in enumerate(self.lengths) if n == 1]
        self.prefill = [i for i, n in enumerate(self.lengths) if n > 1]

    def take(self, t: torch.Tensor, seqs: list[int]) -> torch.Tensor:
        """The rows of t [T, ...] of the tokens of ``seqs``: t itself (a view, strides kept)
        when they are all of it."""
        if len(seqs) == len(self.lengths) and self.starts[0] == 0 \
                and self.starts[-1] + self.lengths[-1] == t.shape[0]:
            return t
        return t[self.rows(seqs)]

    def rows(self, seqs: list[int]) -> torch.Tensor:
        """The batch rows of the tokens of ``seqs`` (in their order), int64."""
        return torch.cat([torch.arange(self.starts[i], self.starts[i] + self.lengths[i])
                          for i in seqs]) if seqs else torch.zeros(0, dtype=torch.long)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: torch.Tensor, split: StepSplit, seqs: list[int]) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of the tokens of ``seqs`` (rows of x [T, C],
    strided views allowed), each sequence continuing after its window ``conv[i]`` [C, K - 1]
    (the K - 1 inputs before its first token), which becomes its last K - 1 inputs: returns
    [tokens of seqs, C] in x's dtype, computed in fp32; weight [C, K].

    All sequences go through one sum of K shifted products: their windows and tokens are laid
    end to end, each token's output reads the K rows ending at its own, which never cross into
    the sequence before."""
    k = weight.shape[1]
    idx = torch.as_tensor(seqs, dtype=torch.long)
    lengths = [split.lengths[i] for i in seqs]
    ends = torch.tensor(lengths).cumsum(0) + (k - 1) * torch.arange(1, len(seqs) + 1)
    token_at = torch.cat([torch.arange(e - n, e) for e, n in zip(ends.tolist(), lengths)])
    window_at = (ends - torch.tensor(lengths) - (k - 1))[:, None] + torch.arange(k - 1)
    buf = x.new_empty(int(ends[-1]), x.shape[1], dtype=torch.float32)
    buf[token_at] = x[split.rows(seqs)].float()
    buf[window_at.reshape(-1)] = conv[idx].transpose(1, 2).reshape(-1, x.shape[1]).float()
    w = weight.float()
    out = buf[token_at] * w[:, k - 1]
    for j in range(k - 1):
        out.addcmul_(buf[token_at - (k - 1 - j)], w[:, j])
    if bias is not None:
        out += bias.float()
    tail = (ends[:, None] - (k - 1) + torch.arange(k - 1)).reshape(-1)
    conv[idx] = buf[tail].view(len(seqs), k - 1, -1).transpose(1, 2).to(conv.dtype)
    return F.silu(out).to(x.dtype)


def conv_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: torch.Tensor, seqs: list[int]) -> torch.Tensor:
    """:func:`causal_conv` of one token per sequence (rows of x [n, C]) -> [n, C] fp32: the
    window and the token times the weight, the window shifted by one."""
    idx = torch.as_tensor(seqs, dtype=torch.long)
    window = torch.cat([conv[idx].float(), x.float()[:, :, None]], -1)
    conv[idx] = window[:, :, 1:].to(conv.dtype)
    out = (window * weight.float()).sum(-1)
    return F.silu(out if bias is None else out + bias.float())


class ChunkLayout:
    """The prefill tokens of ``seqs`` (a :class:`StepSplit`'s) as chunks of ``chunk`` positions,
    each sequence starting a new chunk and its last one zero-padded: :meth:`pad` lays rows out
    as [chunks, chunk, ...], :meth:`unpad` reads them back, :meth:`steps` gives the chunks of
    each position in the sequences (the chunked scans run over chunks in order)."""

    def __init__(self, split: StepSplit, seqs: list[int], chunk: int) -> None:
        self.chunk, self.seqs = chunk, seqs
        self.rows = split.rows(seqs)
        counts = [math.ceil(split.lengths[i] / chunk) for i in seqs]
        first = [0]
        for c in counts:
            first.append(first[-1] + c)
        self.num_chunks, self.counts, self.first = first[-1], counts, first[:-1]
        self.index = torch.cat([torch.arange(split.lengths[i]) + f * chunk
                                for i, f in zip(seqs, self.first)])

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of the tokens of ``seqs`` (in their order; ``x[self.rows]`` of the step
        batch) -> [chunks, chunk, ...], zeros in the padding."""
        out = x.new_zeros(self.num_chunks * self.chunk, *x.shape[1:])
        out[self.index] = x
        return out.view(self.num_chunks, self.chunk, *x.shape[1:])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[chunks, chunk, ...] -> the rows of the tokens of ``seqs``, in their order."""
        return y.reshape(self.num_chunks * self.chunk, *y.shape[2:])[self.index]

    def steps(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per chunk position i: (the i-th chunk of each sequence that has one, those
        sequences' positions in ``seqs``), both int64."""
        out = []
        for i in range(max(self.counts, default=0)):
            which = [j for j, c in enumerate(self.counts) if c > i]
            out.append((torch.tensor([self.first[j] + i for j in which]), torch.tensor(which)))
        return out
