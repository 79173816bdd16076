"""StateStore: the state slots of a model with state layers (``ledger/kv_groups.StateGroup``:
gated DeltaNet, LFM2's short convolution, Mamba-2), beside the KV blocks of its attention
layers.

One slot per running sequence (``max_num_seqs`` slots): per state layer a convolution window
``[slots, conv_dim, kernel - 1]`` and a recurrent state ``[slots, *recurrent_shape]`` (none
for a convolution-only layer), in the compute dtype. The KV manager takes a slot at a
request's admission (zeroed: the state of no token) and gives it back when the request
finishes or is preempted (preemption recomputes, as for the blocks). The store holds exactly
``slots x ledger.kv.fixed_state_bytes(spec, element bytes)`` bytes; tests check the
equality.

Each step the runner hands the model a :class:`StepState` (``AttentionMetadata.state``): the
step's sequences' slots in step order and their :class:`~kvledger.model.layers.state.StateMeta`.
A state layer gathers its rows (:meth:`StepState.gather`, a copy), its mixer updates them in
place, and :meth:`StepState.scatter` writes them back to the slots.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import fixed_state_bytes
from kvledger.ledger.kv_groups import StateGroup
from kvledger.model.layers.state import LayerState, StateMeta
from kvledger.spec import ModelSpec

log = logging.getLogger("kvledger.engine")


def state_pool_bytes(spec: ModelSpec, num_slots: int, dtype: torch.dtype) -> int:
    """The ledger's bytes of ``num_slots`` state slots of ``spec`` in ``dtype`` (0 without
    state layers): what a :class:`StateStore` holds."""
    return num_slots * fixed_state_bytes(spec, dtype.itemsize)


def state_config(config, spec: ModelSpec):
    """``config`` as the engine runs a model with state layers: prefix caching off (a hit
    would need the state at the hit's end, which no slot keeps yet; logged), and refused by
    name what does not run on them yet. Unchanged for a model without state layers.

    Raises:
        InvalidParameterError: tensor parallelism or ``--no-kv-cache`` on a state model.
    """
    if not spec.state_layers:
        return config
    what = f"{spec.model_type}'s {len(spec.state_layers)} state layers"
    if config.tensor_parallel_size > 1:
        raise InvalidParameterError(f"--tensor-parallel-size does not run on {what} yet")
    if not config.use_kv_cache:
        raise InvalidParameterError(f"--no-kv-cache does not run on {what}: their state is "
                                    "carried from chunk to chunk in its slot")
    if config.enable_prefix_caching:
        log.info("prefix caching is off on %s: a hit needs their state at its end", what)
        config = dataclasses.replace(config, enable_prefix_caching=False)
    return config


class StateStore:
    """The state slots (module docstring).

    Args:
        group: the model's state layers and shapes (``kv_groups.state_group``).
        num_slots: slots, one per sequence that may run at once.
        dtype: element type of the state (the compute dtype).
    """

    def __init__(self, group: StateGroup, num_slots: int, dtype: torch.dtype) -> None:
        self.group, self.num_slots = group, num_slots
        self.index = {layer: i for i, layer in enumerate(group.layers)}
        self.conv = [torch.zeros((num_slots, *group.conv_shape), dtype=dtype)
                     for _ in group.layers]
        self.recurrent = [torch.zeros((num_slots, *group.recurrent_shape), dtype=dtype)
                          if group.recurrent_shape else None for _ in group.layers]
        self._free = list(range(num_slots))

    @property
    def nbytes(self) -> int:
        """Bytes of every slot of every state layer (what the ledger predicts)."""
        tensors = self.conv + [t for t in self.recurrent if t is not None]
        return sum(t.nbytes for t in tensors)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot, zeroed (the state before any token).

        Raises:
            InvalidParameterError: every slot is taken (more sequences run than
                ``max_num_seqs``: a scheduler bug).
        """
        if not self._free:
            raise InvalidParameterError(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        for t in self.conv + self.recurrent:
            if t is not None:
                t[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back."""
        self._free.append(slot)

    def step(self, slots: list[int], meta: StateMeta) -> StepState:
        """The step's view of the slots ``slots`` (one per sequence of ``meta``, in order)."""
        return StepState(self, torch.tensor(slots, dtype=torch.int64), meta)


class StepState:
    """One step's state slots, gathered and scattered per state layer (module docstring)."""

    def __init__(self, store: StateStore, slots: torch.Tensor, meta: StateMeta) -> None:
        self.store, self.slots, self.meta = store, slots, meta

    def gather(self, layer: int) -> LayerState:
        """Layer ``layer``'s state of the step's sequences (copies, row i = sequence i)."""
        i = self.store.index[layer]
        recurrent = self.store.recurrent[i]
        return LayerState(self.store.conv[i].index_select(0, self.slots),
                          None if recurrent is None else recurrent.index_select(0, self.slots))

    def scatter(self, layer: int, state: LayerState) -> None:
        """Write ``state`` (as :meth:`gather` gave it, updated) back to the slots."""
        i = self.store.index[layer]
        self.store.conv[i].index_copy_(0, self.slots, state.conv.to(self.store.conv[i].dtype))
        recurrent = self.store.recurrent[i]
        if recurrent is not None:
            recurrent.index_copy_(0, self.slots, state.recurrent.to(recurrent.dtype))
