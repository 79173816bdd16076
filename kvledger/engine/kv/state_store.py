"""StateStore: the state slots of a model with state layers (``ledger/kv_groups.StateGroup``:
gated DeltaNet, LFM2's short convolution, Mamba-2), beside the KV blocks of its attention
layers, and the state checkpoints that let such a model hit the prefix cache.

One slot per running sequence (``max_num_seqs`` slots): per state layer a convolution window
``[conv_dim, kernel - 1]`` and a recurrent state ``recurrent_shape`` (none for a
convolution-only layer), in the compute dtype. The KV manager takes a slot at a request's
admission (zeroed: the state of no token, or a checkpoint's copy on a prefix hit) and gives it
back when the request finishes or is preempted (preemption recomputes, as for the blocks).

Checkpoints (when every state layer's mixer takes them, ``model/layers/state.py``): rows
after the slots, each the state of a sequence at the end of one KV block, kept while that
block is: the runner asks for one every ``interval`` blocks of a chunk
(``ledger.kv.checkpoint_interval_blocks``: the state's bytes against a block's) and at the
last full block of a prompt; the pool's release hook drops it with its block
(:meth:`StateStore.release_block`), so checkpoints are evictable exactly as the blocks they
end. A prefix hit is cut back to the last hit block that has one, whose copy starts the
request's slot. There are ``pool blocks // interval`` of them.

The store holds exactly ``(slots + checkpoints) x ledger.kv.fixed_state_bytes(spec, element
bytes)``; tests check the equality. Each step the runner hands the model a :class:`StepState`
(``AttentionMetadata.state``): the step's slots in step order, their
:class:`~kvledger.model.layers.state.StateMeta` and the checkpoint rows asked for. A state
layer gathers its rows (:meth:`StepState.gather`, a copy), its mixer updates them in place,
and :meth:`StepState.scatter` writes them and the snapshots back.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import checkpoint_interval_blocks, fixed_state_bytes
from kvledger.ledger.kv_groups import StateGroup, state_group
from kvledger.model.layers.state import LayerState, StateMeta
from kvledger.spec import ModelSpec

log = logging.getLogger("kvledger.engine")


def state_pool_bytes(spec: ModelSpec, num_slots: int, dtype: torch.dtype) -> int:
    """The ledger's bytes of ``num_slots`` state rows of ``spec`` in ``dtype`` (0 without
    state layers)."""
    return num_slots * fixed_state_bytes(spec, dtype.itemsize)


def state_config(config, spec: ModelSpec):
    """Refuse by name what does not run on a model with state layers yet; nothing for a model
    without.

    Raises:
        InvalidParameterError: tensor parallelism, ``--no-kv-cache`` or speculative decoding
            on a state model.
    """
    if not spec.state_layers:
        return
    what = f"{spec.model_type}'s {len(spec.state_layers)} state layers"
    if config.tensor_parallel_size > 1:
        raise InvalidParameterError(f"--tensor-parallel-size does not run on {what} yet")
    if not config.use_kv_cache:
        raise InvalidParameterError(f"--no-kv-cache does not run on {what}: their state is "
                                    "carried from chunk to chunk in its slot")
    if config.speculative.enabled:
        raise InvalidParameterError(f"speculative_config does not run on {what} yet: a rejected "
                                    "proposal would have advanced the state, which is not rolled "
                                    "back")


def releasing(release, states: StateStore | None):
    """The pool's release hook ``release`` (None: none), which also drops the block's state
    checkpoint on a state model that takes them (else ``release`` itself)."""
    if states is None or not states.num_checkpoints:
        return release

    def hook(block_id: int) -> None:
        if release is not None:
            release(block_id)
        states.release_block(block_id)
    return hook


@dataclass(frozen=True)
class StateLayout:
    """How an engine keeps a state model's state: its group, ``slots`` rows, and a checkpoint
    every ``interval`` blocks (0: no checkpoints, prefix caching off)."""

    group: StateGroup
    slots: int
    interval: int
    row_bytes: int
    dtype: torch.dtype

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the slots, outside the blocks."""
        return self.slots * self.row_bytes

    def sizing_bytes_per_block(self, bytes_per_block: int) -> int:
        """What one pool block costs with its share of checkpoints (the pool's sizing)."""
        return bytes_per_block + (-(-self.row_bytes // self.interval) if self.interval else 0)

    def build(self, num_blocks: int) -> StateStore:
        return StateStore(self.group, self.slots, self.dtype,
                          num_blocks // self.interval if self.interval else 0, self.interval)


def state_layout(config, spec: ModelSpec, dtype: torch.dtype, model, bytes_per_block: int
                 ) -> tuple[StateLayout | None, object]:
    """(the layout of ``spec``'s state, None without state layers; ``config`` as the engine
    runs it: prefix caching off, logged, unless every state mixer of ``model`` takes
    checkpoints)."""
    group = state_group(spec)
    if group is None:
        return None, config
    mixers = [model.layers[i]["attn"].mixer for i in group.layers]
    checkpoints = config.enable_prefix_caching and all(
        getattr(m, "CHECKPOINTS", False) for m in mixers)
    if config.enable_prefix_caching and not checkpoints:
        log.info("prefix caching is off on %s: its state mixers take no checkpoints",
                 spec.model_type)
        config = dataclasses.replace(config, enable_prefix_caching=False)
    row = fixed_state_bytes(spec, dtype.itemsize)
    interval = (config.state_checkpoint_blocks or checkpoint_interval_blocks(row, bytes_per_block)
                if checkpoints else 0)
    return StateLayout(group, config.max_num_seqs, interval, row, dtype), config


class StateStore:
    """The state slots and checkpoints (module docstring).

    Args:
        group: the model's state layers and shapes (``kv_groups.state_group``).
        num_slots: slots, one per sequence that may run at once.
        dtype: element type of the state (the compute dtype).
        num_checkpoints: checkpoint rows; interval: blocks between two checkpoints.
    """

    def __init__(self, group: StateGroup, num_slots: int, dtype: torch.dtype,
                 num_checkpoints: int = 0, interval: int = 0) -> None:
        self.group, self.num_slots = group, num_slots
        self.num_checkpoints, self.interval = num_checkpoints, interval
        self.index = {layer: i for i, layer in enumerate(group.layers)}
        rows = num_slots + num_checkpoints
        self.conv = [torch.zeros((rows, *group.conv_shape), dtype=dtype) for _ in group.layers]
        self.recurrent = [torch.zeros((rows, *group.recurrent_shape), dtype=dtype)
                          if group.recurrent_shape else None for _ in group.layers]
        self._free = list(range(num_slots))
        self._free_checkpoints = list(range(num_slots, rows))
        self._checkpoint_of: dict[int, int] = {}  # block id -> its checkpoint row

    @property
    def nbytes(self) -> int:
        """Bytes of every row of every state layer (what the ledger predicts)."""
        tensors = self.conv + [t for t in self.recurrent if t is not None]
        return sum(t.nbytes for t in tensors)

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot (or checkpoint) over every state layer."""
        return sum(t[0].nbytes for t in self._tensors())

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in self.conv + self.recurrent if t is not None]

    def allocate(self, block_id: int | None = None) -> int:
        """A free slot, zeroed (the state before any token), or a copy of the checkpoint at
        the end of block ``block_id`` (a prefix hit).

        Raises:
            InvalidParameterError: every slot is taken (more sequences run than
                ``max_num_seqs``: a scheduler bug).
        """
        if not self._free:
            raise InvalidParameterError(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        for t in self._tensors():
            if block_id is None:
                t[slot].zero_()
            else:
                t[slot].copy_(t[self._checkpoint_of[block_id]])
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back."""
        self._free.append(slot)

    def reserve_checkpoint(self, block_id: int) -> int | None:
        """A row for the state at the end of block ``block_id``; None when it has one already
        or none is free."""
        if block_id in self._checkpoint_of or not self._free_checkpoints:
            return None
        row = self._free_checkpoints.pop()
        self._checkpoint_of[block_id] = row
        return row

    def release_block(self, block_id: int) -> None:
        """Block ``block_id`` keeps nothing any more (the pool's release hook): its checkpoint
        goes too."""
        row = self._checkpoint_of.pop(block_id, None)
        if row is not None:
            self._free_checkpoints.append(row)

    def restorable(self, blocks: list[int]) -> int:
        """Leading blocks of a hit ``blocks`` up to the last that ends at a checkpoint."""
        return next((j + 1 for j in range(len(blocks) - 1, -1, -1)
                     if blocks[j] in self._checkpoint_of), 0)

    def step(self, slots: list[int], meta: StateMeta,
             checkpoints: dict[tuple[int, int], int] | None = None) -> StepState:
        """The step's view of the slots ``slots`` (one per sequence of ``meta``, in order);
        ``checkpoints``: (sequence, offset) -> the row its snapshot goes to."""
        return StepState(self, torch.tensor(slots, dtype=torch.int64), meta, checkpoints or {})


class StepState:
    """One step's state slots, gathered and scattered per state layer (module docstring)."""

    def __init__(self, store: StateStore, slots: torch.Tensor, meta: StateMeta,
                 checkpoints: dict[tuple[int, int], int]) -> None:
        self.store, self.slots, self.meta, self.checkpoints = store, slots, meta, checkpoints

    def gather(self, layer: int) -> LayerState:
        """Layer ``layer``'s state of the step's sequences (copies, row i = sequence i)."""
        i = self.store.index[layer]
        recurrent = self.store.recurrent[i]
        return LayerState(self.store.conv[i].index_select(0, self.slots),
                          None if recurrent is None else recurrent.index_select(0, self.slots))

    def scatter(self, layer: int, state: LayerState) -> None:
        """Write ``state`` (as :meth:`gather` gave it, updated) back to the slots, and its
        snapshots to their checkpoint rows."""
        i = self.store.index[layer]
        conv, recurrent = self.store.conv[i], self.store.recurrent[i]
        conv.index_copy_(0, self.slots, state.conv.to(conv.dtype))
        if recurrent is not None:
            recurrent.index_copy_(0, self.slots, state.recurrent.to(recurrent.dtype))
        for seq, offset, window, rec in state.snapshots:
            row = self.checkpoints.get((seq, offset))
            if row is not None:
                conv[row].copy_(window)
                if recurrent is not None:
                    recurrent[row].copy_(rec)
