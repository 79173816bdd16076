"""What attention needs to know about one step, built once and shared by all layers.

A step's tokens are flattened to ``[T]``: first one token for each decoding sequence (in
*decode groups*), then the new tokens of each prefill chunk, one *segment* per sequence. New K/V
are written to their slots first (``slot_mapping``), then each query attends over its
sequence's context.

The runner describes contexts by slot indices (``slot = block_id * block_size + offset``). The
paged backends want the block-table form instead (block ids per sequence, context length per
query): :meth:`DecodeGroup.paged` and :meth:`PrefillSegment.paged` derive it once per step and
keep it, so all layers share one copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PagedQueries:
    """Queries in block-table form: query i sees the first ``context_lens[i]`` positions of
    sequence ``seq_of_query[i]``, whose blocks are ``block_tables[seq_of_query[i]]``.

    Attributes:
        block_tables: [num_seqs, max_blocks] int32 block ids (rows padded with a valid id).
        seq_of_query: [num_queries] int32 row of ``block_tables``.
        context_lens: [num_queries] int32, >= 1.
    """

    block_tables: torch.Tensor
    seq_of_query: torch.Tensor
    context_lens: torch.Tensor


def _block_table(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block ids [..., ceil(L / block_size)] of slot rows [..., L] that follow block tables."""
    return torch.div(slots[..., ::block_size], block_size, rounding_mode="floor").to(torch.int32)


@dataclass
class DecodeGroup:
    """``num_seqs`` decode tokens (one per sequence) from flat offset ``start``.

    ``slots``: [num_seqs, max_context] int64 slot of each context position (padding repeats a
    valid slot); ``mask``: [num_seqs, 1, 1, max_context] bool (True = attend) or None when all
    contexts have the same length. ``slot_view``: the slots are any list (a sequence under an
    evicting retention policy, with holes and moved tokens), not whole blocks of block tables:
    the paged form then treats every slot as a block of one token.
    """

    start: int
    num_seqs: int
    slots: torch.Tensor
    mask: torch.Tensor | None
    slot_view: bool = False
    _paged: PagedQueries | None = field(default=None, repr=False)

    def paged(self, block_size: int) -> PagedQueries:
        """The group in block-table form (computed on first use, then cached); with
        ``slot_view`` the table lists slots, for the pool viewed as blocks of one token."""
        if self._paged is None:
            if self.mask is None:
                lens = torch.full((self.num_seqs,), self.slots.shape[1], dtype=torch.int32,
                                  device=self.slots.device)
            else:
                lens = self.mask.reshape(self.num_seqs, -1).sum(-1, dtype=torch.int32)
            tables = self.slots.to(torch.int32) if self.slot_view else _block_table(
                self.slots, block_size)
            self._paged = PagedQueries(tables.contiguous(), torch.arange(
                self.num_seqs, dtype=torch.int32, device=self.slots.device), lens)
        return self._paged


@dataclass
class PrefillSegment:
    """``length`` new tokens of one sequence starting at flat offset ``start``.

    ``slots``: [context_len] int64 slots of the whole context (cached prefix + new tokens), or
    None when the segment has no prefix (causal attention over the new K/V alone).
    ``mask``: [length, context_len] bool, set together with ``slots``.
    ``gathered``: the context is any list of slots (a sequence under an evicting retention
    policy: holes, moved tokens, per-query windows), read by gather + SDPA in every backend.
    ``key_turn``: (rows [r], cos [r, 1, D], sin [r, 1, D]) of a gathered context whose keys at
    those rows rotate forward after the gather (``cache`` positions, ``retention/state.py``).
    """

    start: int
    length: int
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    gathered: bool = False
    key_turn: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _paged: PagedQueries | None = field(default=None, repr=False)

    def paged(self, block_size: int) -> PagedQueries:
        """Block-table form of a segment with a prefix: new token i sees ``prefix + i + 1``
        positions (computed on first use, then cached)."""
        if self._paged is None:
            context = self.slots.shape[0]
            on = self.slots.device
            lens = torch.arange(context - self.length + 1, context + 1, dtype=torch.int32,
                                device=on)
            self._paged = PagedQueries(_block_table(self.slots, block_size)[None].contiguous(),
                                       torch.zeros(self.length, dtype=torch.int32, device=on),
                                       lens)
        return self._paged


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step, built once and shared by all layers."""

    slot_mapping: torch.Tensor | None
    seal: torch.Tensor | None = None
    """Block ids [n] int64 a quantized store seals this step, after writing (whole key groups
    in order, ``QuantizedKVStore.write``); None: a full-precision store."""
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSegment] = field(default_factory=list)
    observers: list = field(default_factory=list)
    """Objects with ``observe(layer, q, store)``, called after each layer's attention
    (retention scores, ``engine/retention/observe.py``)."""
    group_of_layer: tuple[int, ...] | None = None
    """Per layer, its layer group (``ledger/kv_groups.py``); None: one group."""
    groups: list[AttentionMetadata] = field(default_factory=list)
    """Per layer group, its metadata (this object first): same queries, its own slots."""
    state: Any = None
    """The step's state slots of a model with state layers (``engine/kv/state_store.py``'s
    ``StepState``, read by ``model/layers/state_block.py``); None: a model without."""

    def to(self, device: torch.device) -> AttentionMetadata:
        """Its tensors (and its layer groups') copied to ``device`` once (non-blocking), in
        place: a step's metadata is built on the CPU and read on the device by every layer.
        State slots (``state``) stay where they are."""
        def on(t):
            return None if t is None else t.to(device, non_blocking=True)

        self.slot_mapping, self.seal = on(self.slot_mapping), on(self.seal)
        for group in self.decodes:
            group.slots, group.mask = on(group.slots), on(group.mask)
        for seg in self.prefills:
            seg.slots, seg.mask = on(seg.slots), on(seg.mask)
            if seg.key_turn is not None:
                seg.key_turn = tuple(on(t) for t in seg.key_turn)
        for meta in self.groups[1:]:
            meta.to(device)
        return self

    def of_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer ``layer`` attends with (its group's)."""
        return self if self.group_of_layer is None else self.groups[self.group_of_layer[layer]]
