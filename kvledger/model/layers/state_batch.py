"""The flat token batch of a step as the state mixers (:mod:`.gated_deltanet`, :mod:`.mamba2`)
read it, and the bookkeeping they share (:class:`ProjectedMixer`): which sequences decode one token and which prefill several (:class:`StepSplit`), the
causal depthwise convolution over each sequence's tokens after its conv window
(:func:`causal_conv`; one token: :func:`conv_update`), and the prefill tokens laid out as
padded chunks per sequence for a chunked scan (:class:`ChunkLayout`).

A step's sequences are spans of the batch (:class:`kvledger.model.layers.state.StateMeta`),
each with its row of the :class:`kvledger.model.layers.state.LayerState` (same order; a fresh
sequence's rows come zeroed). The checkpoints the engine wants (the state after so many tokens
of a span) are cut points: the conv gives its window there, and a chunk of the layout ends
there, so the scan holds the state after it (:class:`Snapshots` gathers both).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvledger.model.layers.linears import held_bytes
from kvledger.model.layers.state import StateMeta


class StepSplit:
    """The step's sequences by how the mixers compute them: ``decode`` (one token: the
    recurrent update) and ``prefill`` (more: the chunked form), each a list of sequence
    indices, with every sequence's ``starts`` and ``lengths`` in the flat batch."""

    def __init__(self, meta: StateMeta) -> None:
        self.starts, self.lengths = list(meta.starts), list(meta.lengths)
        self.decode = [i for i, n in enumerate(self.lengths) if n == 1]
        self.prefill = [i for i, n in enumerate(self.lengths) if n > 1]
        self.checkpoints = meta.checkpoints

    def wanted(self, i: int) -> tuple[int, ...]:
        """The offsets into sequence ``i``'s span after which the engine wants the state."""
        return tuple(self.checkpoints[i]) if self.checkpoints else ()

    def _whole(self, seqs: list[int], rows: int) -> bool:
        """Whether the tokens of ``seqs`` are all ``rows`` rows of the batch."""
        return len(seqs) == len(self.lengths) and self.starts[0] == 0 \
            and self.starts[-1] + self.lengths[-1] == rows

    def take(self, t: torch.Tensor, seqs: list[int]) -> torch.Tensor:
        """The rows of t [T, ...] of the tokens of ``seqs``: t itself (a view, strides kept)
        when they are all of it."""
        return t if self._whole(seqs, t.shape[0]) else t[self.rows(seqs)]

    def assemble(self, parts: list[tuple[list[int], torch.Tensor]], rows: int) -> torch.Tensor:
        """The batch's ``rows`` rows from parts (seqs, the rows of their tokens in order)."""
        if len(parts) == 1 and self._whole(parts[0][0], rows):
            return parts[0][1]
        out = parts[0][1].new_empty(rows, *parts[0][1].shape[1:])
        for seqs, values in parts:
            out[self.rows(seqs)] = values
        return out

    def rows(self, seqs: list[int]) -> torch.Tensor:
        """The batch rows of the tokens of ``seqs`` (in their order), int64."""
        if all(self.lengths[i] == 1 for i in seqs):
            return torch.tensor([self.starts[i] for i in seqs], dtype=torch.long)
        return torch.cat([torch.arange(self.starts[i], self.starts[i] + self.lengths[i])
                          for i in seqs])


class Snapshots:
    """The conv windows and recurrent states of a step's checkpoints, by (sequence, offset),
    appended to ``LayerState.snapshots`` once both are in (:meth:`flush`)."""

    def __init__(self) -> None:
        self.conv: dict[tuple[int, int], torch.Tensor] = {}
        self.recurrent: dict[tuple[int, int], torch.Tensor] = {}

    def flush(self, state) -> None:
        """``(sequence, offset, conv, recurrent)`` per checkpoint, in step order."""
        for key in sorted(self.conv):
            state.snapshots.append((*key, self.conv[key], self.recurrent[key]))

    def after_decode(self, state, split: StepSplit, seqs: list[int]) -> None:
        """The states of the decoded ``seqs`` that want a checkpoint after their token."""
        for i in seqs:
            if 1 in split.wanted(i):
                self.conv[i, 1] = state.conv[i].clone()
                self.recurrent[i, 1] = state.recurrent[i].clone()


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                conv: torch.Tensor, split: StepSplit, seqs: list[int],
                snapshots: Snapshots) -> torch.Tensor:
    """SiLU of the causal depthwise convolution of the tokens of ``seqs`` (rows of x [T, C],
    strided views allowed), each sequence continuing after its window ``conv[i]`` [C, K - 1]
    (the K - 1 inputs before its first token), which becomes its last K - 1 inputs: returns
    fp32 [tokens of seqs, C]; weight fp32 [C, K]. The window after each wanted offset goes to
    ``snapshots``.

    All sequences go through one sum of K shifted products: their windows and tokens are laid
    end to end, each token's output reads the K rows ending at its own, which never cross into
    the sequence before (the outputs at window rows are computed and dropped)."""
    w = weight.shape[1] - 1
    segments, at = [], 0
    for i in seqs:
        segments.append((i, at, split.starts[i], split.lengths[i]))
        at += w + split.lengths[i]
    buf = torch.empty(at, x.shape[1])
    for i, seg, start, n in segments:
        buf[seg:seg + w] = conv[i].t()
        buf[seg + w:seg + w + n] = x[start:start + n]
    full = buf[w:] * weight[:, w]  # full[r]: the output at buf row r + w
    for j in range(w):
        full.addcmul_(buf[j:at - w + j], weight[:, j])
    if bias is not None:
        full += bias
    for i, seg, _, n in segments:
        conv[i] = buf[seg + n:seg + n + w].t()
        for o in split.wanted(i):
            snapshots.conv[i, o] = buf[seg + o:seg + o + w].t().to(conv.dtype)
    out = full if len(segments) == 1 else torch.cat([full[seg:seg + n]
                                                     for _, seg, _, n in segments])
    return F.silu(out, inplace=True)


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
    """The prefill tokens of ``seqs`` (a :class:`StepSplit`'s) as chunks of at most ``chunk``
    tokens, each sequence starting a new chunk and cut at its wanted checkpoints too, every
    chunk zero-padded to ``chunk`` positions; laid out position-major: the sequences ranked by
    their number of chunks (most first), chunk i of every sequence that has one sits together,
    ranks in order. So the chunked scans' step i reads one slice of chunks and the first ``m``
    rows of the states (:meth:`steps`).

    :meth:`pad` lays rows out as [chunks, chunk, ...], :meth:`unpad` reads them back;
    ``ranked`` are the sequences of ``seqs`` in rank order (the order of the scans' states)."""

    def __init__(self, split: StepSplit, seqs: list[int], chunk: int) -> None:
        self.chunk = chunk
        pieces = []  # per sequence of seqs: (start, tokens, checkpoint offset or 0) per chunk
        for i in seqs:
            cuts = sorted({o for o in split.wanted(i) if 0 < o < split.lengths[i]}
                          | {split.lengths[i]})
            own, at = [], 0
            for cut in cuts:
                while at < cut:
                    n = min(chunk, cut - at)
                    own.append((at, n, cut if at + n == cut and cut in split.wanted(i) else 0))
                    at += n
            pieces.append(own)
        order = sorted(range(len(seqs)), key=lambda j: -len(pieces[j]))
        self.ranked = [seqs[j] for j in order]
        longest = len(pieces[order[0]]) if seqs else 0
        self.active = [sum(len(p) > c for p in pieces) for c in range(longest)]
        self.first = [0]
        for m in self.active:
            self.first.append(self.first[-1] + m)
        self.num_chunks = self.first[-1]
        rank = {j: r for r, j in enumerate(order)}
        self.marks: list[list[tuple[int, int, int]]] = [[] for _ in self.active]
        index = []
        for j, own in enumerate(pieces):
            for c, (start, n, mark) in enumerate(own):
                index.append(torch.arange(n) + (self.first[c] + rank[j]) * chunk)
                if mark:
                    self.marks[c].append((rank[j], seqs[j], mark))
        self.index = torch.cat(index)
        self.in_order = bool((self.index == torch.arange(len(self.index))).all())

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of the tokens of ``seqs`` (in their order) -> [chunks, chunk, ...], zeros in
        the padding."""
        out = x.new_zeros(self.num_chunks * self.chunk, *x.shape[1:])
        if self.in_order:
            out[:x.shape[0]] = x
        else:
            out[self.index] = x
        return out.view(self.num_chunks, self.chunk, *x.shape[1:])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[chunks, chunk, ...] -> the rows of the tokens of ``seqs``, in their order."""
        flat = y.reshape(self.num_chunks * self.chunk, *y.shape[2:])
        return flat[:len(self.index)] if self.in_order else flat[self.index]

    def steps(self) -> list[tuple[slice, int, list[tuple[int, int, int]]]]:
        """Per chunk position i: (the slice of the chunks at i, how many sequences have one:
        the first that many in rank order, and (rank, sequence, offset) of each chunk there
        that ends at a wanted checkpoint: the state after it is that checkpoint's)."""
        return [(slice(self.first[i], self.first[i] + m), m, self.marks[i])
                for i, m in enumerate(self.active)]


class ProjectedMixer:
    """What a state mixer with an ``in_proj`` and an ``out_proj`` Linear tells the decoder:
    its Linears by shape class and its bytes; a subclass lists its other tensors in
    ``_small()``."""

    in_proj: object
    out_proj: object

    def _small(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def linears(self, shape_class: str) -> list:
        """Its Linears of ``qkv`` (in_proj) or ``o`` (out_proj): the classes of the attention
        whose place it takes, as the decoder picks formats by."""
        return {"qkv": [self.in_proj], "o": [self.out_proj]}.get(shape_class, [])

    @property
    def decode_bytes(self) -> int:
        """Weight bytes one decode step reads (its state aside)."""
        return self.in_proj.nbytes + self.out_proj.nbytes + sum(
            t.nbytes for t in self._small())

    @property
    def held_bytes(self) -> int:
        """Bytes of every tensor held."""
        return held_bytes(self.in_proj) + held_bytes(self.out_proj) + sum(
            t.nbytes for t in self._small())
