"""PROVISIONAL copy of the agreed interface (i59a owns this module; replaced by theirs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateMeta:
    """The step's sequences: ``cu_seqlens`` [num_seqs + 1] token offsets in the flat batch (in
    step order), ``fresh`` [num_seqs] bool: the sequence starts from an empty state."""

    cu_seqlens: torch.Tensor
    fresh: torch.Tensor


@dataclass
class LayerState:
    """One state layer's slots gathered for the step's sequences, read and updated in place:
    ``conv`` [num_seqs, conv_dim, kernel - 1], ``recurrent`` [num_seqs, ...]."""

    conv: torch.Tensor
    recurrent: torch.Tensor
