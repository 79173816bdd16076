"""Steps under tensor parallelism: rank 0 builds each step's inputs and broadcasts them once;
every rank runs its share of the forward pass on the same block ids of its own KV store.

The scheduler and block manager live on rank 0 only (one source of truth for block tables):
the flat token ids, positions, slot mapping and attention metadata that
:meth:`ModelRunner.batch` derives from them are all another rank needs to write its K/V heads
into the same slots and attend over the same contexts. Sampling stays on rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kvledger.engine.attention import AttentionMetadata
from kvledger.engine.kv.store import KVStore
from kvledger.engine.model import LlamaModel
from kvledger.engine.parallel.group import RankGroup
from kvledger.engine.runner import ModelRunner


@dataclass
class Step:
    """One step's inputs as broadcast to every rank.

    Attributes:
        input_ids, positions: [T] int64; meta: the attention metadata (slot mapping, decode
        groups, prefill segments); rows: [N] int64 rows whose logits are wanted; logits:
        False when the step only wants hidden states (``kvledger eval``).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: torch.Tensor
    logits: bool


def run_step(model: LlamaModel, store: KVStore | None, step: Step) -> torch.Tensor:
    """Hidden states [T, hidden], or logits [N, vocab] (rank 0; [N, 0] elsewhere)."""
    hidden = model.forward(step.input_ids, step.positions, step.meta, store)
    return model.compute_logits(hidden[step.rows]) if step.logits else hidden


class ParallelRunner(ModelRunner):
    """Rank 0's runner: :class:`ModelRunner` whose every step is broadcast to the ranks first.

    Raises (from each step): TensorParallelError: a rank died or a collective timed out.
    """

    def __init__(self, model: LlamaModel, store: KVStore | None, block_size: int,
                 group: RankGroup) -> None:
        super().__init__(model, store, block_size)
        self.group = group

    def execute(self, chunks: Seq) -> torch.Tensor:
        """Logits [num_sampling_chunks, vocab] (fp32) of the whole model, as ModelRunner's."""
        return self._step(chunks, logits=True)

    def hidden_states(self, chunks: Seq) -> torch.Tensor:
        """Final hidden states [T, hidden] (identical on every rank after the all-reduce)."""
        return self._step(chunks, logits=False)

    def _step(self, chunks: Seq, logits: bool) -> torch.Tensor:
        step = Step(*self.batch(chunks), logits=logits)
        self.group.broadcast(step)
        return run_step(self.model, self.store, step)
