"""Steps under tensor parallelism: rank 0 builds each step's inputs and broadcasts them once;
every rank runs its share of the forward pass on the same block ids of its own KV store.

The scheduler and block manager live on rank 0 only (one source of truth for block tables):
the flat token ids, positions, slot mapping and attention metadata that
:meth:`ModelRunner.batch` derives from them are all another rank needs to write its K/V heads
into the same slots and attend over the same contexts. Sampling stays on rank 0.

Two kinds of KV-store changes happen on rank 0 between steps, outside the forward pass, and
every rank must make them too: retention *compaction* (h2o, snapkv: ``retention/state.py``
moves kept K/V to other slots) and a quantized store's *release* of the residual buffer of a
partial block the pool freed. Rank 0's scheduler and pool hand them to
:meth:`ParallelRunner.copy_slots` and :meth:`ParallelRunner.release`, which queue them; they
travel with the next step's inputs and every rank, rank 0 included, makes them in order
before that step's forward pass, so all stores hold the same tokens in the same slots (until
then nothing reads the store: the scheduler only decides, the forward reads and writes).

Retention *scores* (``retention/observe.py``) are sums over heads, and each rank sees only its
own query heads: after the forward the observers' scores are all-reduced, so rank 0's
observers hold the sum over every head, as one process computes it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from kvledger.engine.attention import AttentionMetadata
from kvledger.engine.kv.store import KVStore
from kvledger.engine.parallel.group import RankGroup
from kvledger.engine.runner import ModelRunner
from kvledger.engine.sample.prompt_logprobs import SliceReducer, logits_in_slices
from kvledger.model.layers.decoder import Decoder


@dataclass
class Step:
    """One step's inputs as broadcast to every rank.

    Attributes:
        input_ids, positions: [T] int64; meta: the attention metadata (slot mapping, decode
        groups, prefill segments, retention observers); rows: [N] int64 rows whose logits are
        wanted; logits: False when the step only wants hidden states (``kvledger eval``);
        store_ops: (method, args) calls on the KV store queued since the last step
        (``copy_slots``, ``release``), made in order before the forward.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: torch.Tensor
    logits: bool
    store_ops: list[tuple[str, tuple]] = field(default_factory=list)


def run_step(model: Decoder, store: KVStore | None, step: Step, group: RankGroup,
             reduce: SliceReducer | None = None) -> torch.Tensor:
    """Hidden states [T, hidden], or logits [N, vocab] (rank 0; [N, 0] elsewhere), computed
    in the same slices on every rank, each through ``reduce`` when given (rank 0's).

    Raises:
        TensorParallelError: a rank died or a collective timed out.
    """
    for method, args in step.store_ops:
        getattr(store, method)(*args)
    hidden = model.forward(step.input_ids, step.positions, step.meta, store)
    observers = step.meta.observers
    if observers:
        scores = torch.cat([o.scores for o in observers])
        group.all_reduce(scores)
        for o, total in zip(observers, scores.split([len(o.scores) for o in observers])):
            o.scores.copy_(total)
    return (logits_in_slices(model.compute_logits, hidden[step.rows], reduce) if step.logits
            else hidden)


class ParallelRunner(ModelRunner):
    """Rank 0's runner: :class:`ModelRunner` whose every step is broadcast to the ranks first.

    Raises (from each step): TensorParallelError: a rank died or a collective timed out.
    """

    def __init__(self, model: Decoder, store: KVStore | None, block_size: int,
                 group: RankGroup) -> None:
        super().__init__(model, store, block_size)
        self.group = group
        self._store_ops: list[tuple[str, tuple]] = []

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V from slots ``src`` [k] to ``dst`` [k] on every rank before the next step's
        forward (where one process calls :meth:`KVStore.copy_slots` at once)."""
        self._store_ops.append(("copy_slots", (src, dst)))

    def release(self, block_id: int) -> None:
        """Block ``block_id`` left every block table: every rank's store releases it before the
        next step's forward (a quantized store's residual buffer; nothing for the others)."""
        if self.store.quantized:
            self._store_ops.append(("release", (block_id,)))

    def execute(self, chunks: Seq, reduce: SliceReducer | None = None) -> torch.Tensor:
        """Logits [num_sampling_chunks, vocab] (fp32) of the whole model, as ModelRunner's."""
        return self._step(chunks, logits=True, reduce=reduce)

    def hidden_states(self, chunks: Seq) -> torch.Tensor:
        """Final hidden states [T, hidden] (identical on every rank after the all-reduce)."""
        return self._step(chunks, logits=False)

    def _step(self, chunks: Seq, logits: bool, reduce: SliceReducer | None = None
              ) -> torch.Tensor:
        step = Step(*self.batch(chunks), logits=logits, store_ops=self._store_ops)
        self._store_ops = []
        self.group.broadcast(step)
        return run_step(self.model, self.store, step, self.group, reduce)
