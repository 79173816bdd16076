"""The fixed per-sequence state of a state layer (a short convolution, gated DeltaNet, Mamba-2)
as a mixer sees it in one step, and where each sequence's tokens sit in the step's batch.

A state mixer is called as ``mixer.forward(x, state, meta)``:

* ``x`` [T, hidden]: the step's flat token batch, every sequence's tokens contiguous, in step
  order (the runner's decodes first, then each prefill chunk);
* ``meta`` (:class:`StateMeta`): per sequence of the step, in that order, the start of its
  tokens in ``x``, how many, and whether it starts from an empty state (its first chunk);
* ``state`` (:class:`LayerState`): this layer's state of the step's sequences, row ``i`` for
  sequence ``i`` of ``meta``: ``conv`` [num_seqs, conv_dim, kernel - 1], the last ``kernel - 1``
  inputs of the causal convolution, oldest first, and ``recurrent`` [num_seqs, ...] (None for a
  layer with a convolution only, LFM2). The engine gathers them from the sequences' slots
  before the step, with the rows of fresh sequences zeroed, and scatters them back after it:
  the mixer reads them and updates them **in place** to the state after its last token.

Both tensors are stored in the engine's compute dtype (what the ledger prices,
``ledger.kv.fixed_state_bytes``; vLLM's default too), as is ``x``: a mixer that computes its
recurrence in float32 casts on the way in and writes back with ``copy_``. The mixer returns
[T, hidden]. The engine's side: ``kvledger.engine.kv.state_store``.

Checkpoints (prefix caching on a state model): ``meta.checkpoints`` lists per sequence the
token counts into its span (1 .. length) after which the engine wants the state; a mixer that
declares ``CHECKPOINTS = True`` appends for each ``(sequence, offset, conv, recurrent)`` to
``state.snapshots`` (copies: the conv window and recurrent state after that many tokens of
the span). The engine turns prefix caching on only when every state layer's mixer does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StateMeta:
    """Where each sequence of the step sits in the flat batch (module docstring)."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    fresh: tuple[bool, ...]
    checkpoints: tuple[tuple[int, ...], ...] = ()
    """Per sequence, the offsets into its span after which a snapshot is wanted (module
    docstring); empty: none this step."""

    @property
    def num_seqs(self) -> int:
        return len(self.starts)

    @property
    def decode_only(self) -> bool:
        """Every sequence brings one token (a pure decode step: a single recurrent update)."""
        return all(n == 1 for n in self.lengths)

    def cu_seqlens(self) -> torch.Tensor:
        """[num_seqs + 1] int32: offsets of the sequences in the batch, the last = T (the
        sequences are contiguous and in order)."""
        ends = [s + n for s, n in zip(self.starts, self.lengths)]
        return torch.tensor([self.starts[0] if self.starts else 0, *ends], dtype=torch.int32)

    def spans(self) -> list[tuple[int, int]]:
        """``(start, length)`` per sequence."""
        return list(zip(self.starts, self.lengths))


@dataclass
class LayerState:
    """One state layer's state of the step's sequences (module docstring)."""

    conv: torch.Tensor
    recurrent: torch.Tensor | None = None
    snapshots: list = field(default_factory=list)
    """``(sequence, offset, conv [conv_dim, kernel - 1], recurrent or None)`` per checkpoint
    of ``StateMeta.checkpoints`` (module docstring), filled by a mixer that takes them."""
