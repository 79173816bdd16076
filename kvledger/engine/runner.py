"""ModelRunner: turns a scheduler step into tensors, runs the model, returns logits.

For each scheduled chunk (a request and how many of its tokens to compute) it builds the flat
step batch: input ids, positions, slot mapping (slot = block_table[pos // block_size] *
block_size + pos % block_size) and the attention metadata (decode group first, then one prefill
segment per chunk). Logits are computed only at the last position of chunks that sample, and
at every position of a chunk whose request wants prompt logprobs, a slice of rows at a time
handed to the step's reducer (``prompt_logprobs.py``).

Each chunk's request says what its queries attend (``request.retention.attention``,
``engine/retention/interface.py``): its prefix through the block table (above), or a
``HeldContext`` when it holds only some of its tokens, anywhere in its blocks (an evicting
policy). Such a chunk is one gathered segment over the held slots, with a mask made of
causality and the policy's per-query visibility, its keys turned as the context says (``cache``
positions) and an attention observer when its queries are scored; a one-token decode that sees
every held key, unturned and unscored, is a decode group read in place (``slot_view``).

Layer groups (``ledger/kv_groups.py``): when the store's layers read more than one block table
(``store.group_of_layer``), each group gets its own metadata (``AttentionMetadata.groups``:
the same queries, the slots of that group's table; a sliding group's ``NULL_BLOCK`` entries
read block 0, masked by the window).

State layers (``engine/kv/state_store.py``): with ``states`` the metadata carries the step's
``StepState``: each chunk's request's state slot and, in the order of the flat batch, where its
tokens sit and whether it starts from no token (``model/layers/state.StateMeta``).

On a device other than the CPU (``device``: a GPU's torch device) the step's inputs and
metadata are built on the CPU as above and copied over once (``AttentionMetadata.to``); every
layer then reads the device's copy.

With ``use_kv_cache=False`` (seed §1.3) nothing is stored: every chunk recomputes its whole
request from position 0, which is what decoding without a KV cache costs.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from kvledger.engine.attention import AttentionMetadata, DecodeGroup, PrefillSegment
from kvledger.engine.kv.state_store import StateStore, StepState
from kvledger.engine.kv.store import KVStore
from kvledger.engine.retention.interface import HeldContext
from kvledger.engine.sample.prompt_logprobs import SliceReducer, logit_rows, logits_in_slices
from kvledger.ledger.step_model import length_groups
from kvledger.model.layers.decoder import Decoder
from kvledger.model.layers.state import StateMeta


class ModelRunner:
    """Runs ``model`` on scheduled chunks against ``store`` (None in no-cache mode); a step's
    inputs go to ``device`` (None: they stay on the CPU)."""

    def __init__(self, model: Decoder, store: KVStore | None, block_size: int,
                 states: StateStore | None = None, device: torch.device | None = None) -> None:
        self.model, self.store, self.block_size = model, store, block_size
        self.states, self.device = states, device
        self._offsets = torch.arange(block_size)

    def execute(self, chunks: Seq, reduce: SliceReducer | None = None) -> torch.Tensor:
        """Logits [rows, vocab] (fp32): each chunk's ``logit_rows`` last rows, in the order of
        ``chunks`` (one row per chunk that samples, unless prompt logprobs are wanted); with
        ``reduce``, what it keeps of each slice of them (``prompt_logprobs.logits_in_slices``).

        ``chunks``: objects with ``request`` (a Request: num_computed_tokens, block_table,
        tokens) and ``num_new_tokens``; a chunk samples when it reaches the end of its request.
        """
        hidden, last = self._forward(chunks)
        return logits_in_slices(self.model.compute_logits, hidden[last], reduce)

    def hidden_states(self, chunks: Seq) -> torch.Tensor:
        """Final hidden states [T, hidden] of every token of the step, decodes first, then each
        prefill chunk's tokens in order (what ``kvledger eval`` scores; writes K/V like
        :meth:`execute`)."""
        return self._forward(chunks)[0]

    def batch(self, chunks: Seq) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                          torch.Tensor]:
        """The step's flat inputs: token ids [T], positions [T], the attention metadata and
        the rows whose logits are wanted (:func:`logit_rows`; what a tensor-parallel step
        broadcasts to the other ranks)."""
        if self.store is None:
            made = self._no_cache_batch(chunks)
        else:
            made = self._paged_batch(chunks)
        if self.device is None:
            return made
        ids, pos, meta, last = made
        on = self.device
        return (ids.to(on, non_blocking=True), pos.to(on, non_blocking=True), meta.to(on),
                last.to(on, non_blocking=True))

    def _forward(self, chunks: Seq) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, meta, last = self.batch(chunks)
        return self.model.forward(ids, pos, meta, self.store), last

    def _paged_batch(self, chunks: Seq):
        held = {}  # id(chunk) -> HeldContext, for the chunks that do not attend their prefix
        for c in chunks:
            req = c.request
            context = req.retention.attention(req.block_table, req.num_computed_tokens,
                                              c.num_new_tokens, req.num_prompt_tokens)
            if context is not None:
                held[id(c)] = context
        plain = [c for c in chunks if id(c) not in held]
        decodes = [c for c in plain if c.num_new_tokens == 1 and c.request.num_computed_tokens > 0]
        prefills = [c for c in plain if not (c.num_new_tokens == 1
                                             and c.request.num_computed_tokens > 0)]
        ids, pos, slots = [], [], []
        meta = AttentionMetadata(slot_mapping=None)
        last_of = {}
        def add_decode(c, slot: int) -> None:  # one decode token: id, position, slot
            p = c.request.num_computed_tokens
            ids.extend(c.request.token_ids_range(p, p + 1))
            pos.append(p)
            slots.append(slot)
            last_of[id(c)] = len(ids) - 1

        decodes.sort(key=lambda c: c.request.num_computed_tokens)
        decode_groups = length_groups(decodes, lambda c: c.request.num_computed_tokens)
        for group in decode_groups:
            contexts = [self._context_slots(c.request, c.request.num_computed_tokens + 1) for c in group]
            meta.decodes.append(_decode_group(len(ids), contexts))
            for c, ctx in zip(group, contexts):
                add_decode(c, int(ctx[-1]))
        for c in (c for c in chunks if id(c) in held):
            context = held[id(c)]
            if c.request.num_computed_tokens > 0 and context.reads_in_place():
                meta.decodes.append(DecodeGroup(len(ids), 1, context.slots[None], None,
                                                slot_view=True))
                add_decode(c, int(context.new_slots[0]))
        slot_chunks = [torch.tensor(slots, dtype=torch.int64)]
        for c in prefills:
            start, n = c.request.num_computed_tokens, c.num_new_tokens
            ctx = self._context_slots(c.request, start + n)
            seg = PrefillSegment(start=len(ids), length=n)
            if start > 0:
                seg.slots = ctx
                seg.mask = _prefix_causal_mask(start, n)
            meta.prefills.append(seg)
            ids.extend(_chunk_token_ids(c))
            pos.extend(range(start, start + n))
            slot_chunks.append(ctx[start:])
            last_of[id(c)] = len(ids) - 1
        for c in (c for c in chunks if id(c) in held and id(c) not in last_of):
            slot_chunks.append(self._held_segment(c, held[id(c)], meta, len(ids)))
            start, n = c.request.num_computed_tokens, c.num_new_tokens
            ids.extend(c.request.token_ids_range(start, start + n))
            pos.extend(range(start, start + n))
            last_of[id(c)] = len(ids) - 1
        meta.slot_mapping = torch.cat(slot_chunks)
        meta.seal = self._seal(chunks, 0)
        if self.states is not None:
            meta.state = self._step_state(chunks, last_of)
        layer_groups = getattr(self.store, "group_of_layer", None)
        if layer_groups is not None:
            meta.group_of_layer = layer_groups
            meta.groups = [meta] + [self._group_meta(g, decode_groups, prefills, meta)
                                    for g in range(1, max(layer_groups) + 1)]
            for g, group_meta in enumerate(meta.groups[1:], 1):
                group_meta.seal = self._seal(chunks, g)
        return _as_tensor(ids), _as_tensor(pos), meta, _wanted_rows(chunks, last_of)

    def _step_state(self, chunks: Seq, last_of: dict) -> StepState:
        """The step's state slots: per chunk, in the order of its tokens in the batch, its
        request's slot, its span, whether it starts from no token, and the checkpoints it
        takes (:meth:`_checkpoints`)."""
        spans = sorted((last_of[id(c)] - c.num_new_tokens + 1, c) for c in chunks)
        rows: dict[tuple[int, int], int] = {}
        wanted = [self._checkpoints(i, c, rows) for i, (_, c) in enumerate(spans)]
        meta = StateMeta(tuple(s for s, _ in spans), tuple(c.num_new_tokens for _, c in spans),
                         tuple(c.request.num_computed_tokens == 0 for _, c in spans),
                         tuple(wanted) if rows else ())
        return self.states.step([c.request.state_slot for _, c in spans], meta, rows)

    def _checkpoints(self, seq: int, c, rows: dict) -> tuple[int, ...]:
        """Offsets into chunk ``c`` (sequence ``seq`` of the step) at the end of a block where
        its state is kept (``engine/kv/state_store.py``): every ``interval`` blocks, and the
        prompt's last full block; each gets a checkpoint row in ``rows``."""
        interval = self.states.interval
        if not interval:
            return ()
        req, bs = c.request, self.block_size
        start, end = req.num_computed_tokens, req.num_computed_tokens + c.num_new_tokens
        ends = set(range((start // (interval * bs) + 1) * interval * bs, end + 1, interval * bs))
        last_full = req.num_prompt_tokens // bs * bs
        if start < last_full <= end:
            ends.add(last_full)
        offsets = []
        for p in sorted(ends):
            row = self.states.reserve_checkpoint(req.block_table[p // bs - 1])
            if row is not None:
                rows[(seq, p - start)] = row
                offsets.append(p - start)
        return tuple(offsets)

    def _group_meta(self, g: int, decode_groups: list[list], prefills: list,
                    first: AttentionMetadata) -> AttentionMetadata:
        """Layer group ``g``'s metadata: ``first``'s decode groups and prefill segments
        over the slots of each request's table ``g``."""
        meta = AttentionMetadata(slot_mapping=None)
        slots = []
        for group, made in zip(decode_groups, first.decodes):
            contexts = [self._context_slots(c.request, c.request.num_computed_tokens + 1, g)
                        for c in group]
            meta.decodes.append(_decode_group(made.start, contexts))
            slots.extend(int(ctx[-1]) for ctx in contexts)
        slot_chunks = [torch.tensor(slots, dtype=torch.int64)]
        for c, made in zip(prefills, first.prefills):
            start, n = c.request.num_computed_tokens, c.num_new_tokens
            ctx = self._context_slots(c.request, start + n, g)
            seg = PrefillSegment(start=made.start, length=n)
            if start > 0:
                seg.slots, seg.mask = ctx, made.mask
            meta.prefills.append(seg)
            slot_chunks.append(ctx[start:])
        meta.slot_mapping = torch.cat(slot_chunks)
        return meta

    def _no_cache_batch(self, chunks: Seq):
        ids, pos, last_of = [], [], {}
        meta = AttentionMetadata(slot_mapping=None)
        for c in chunks:
            end = c.request.num_computed_tokens + c.num_new_tokens
            meta.prefills.append(PrefillSegment(start=len(ids), length=end))
            ids.extend(c.request.token_ids_range(0, end))
            pos.extend(range(end))
            last_of[id(c)] = len(ids) - 1
        return _as_tensor(ids), _as_tensor(pos), meta, _wanted_rows(chunks, last_of)

    def _held_segment(self, c, context: HeldContext, meta: AttentionMetadata,
                      offset: int) -> torch.Tensor:
        """Add the gathered segment of a chunk over ``context`` (and its attention observer
        when its queries are scored); returns the new tokens' slots."""
        n = c.num_new_tokens
        seg = PrefillSegment(start=offset, length=n, slots=context.slots, mask=context.mask,
                             gathered=True)
        if context.key_turn is not None and self.model.rope is not None:  # nope: no turn
            rows, delta = context.key_turn
            cos, sin = self.model.rope.lookup(delta)
            seg.key_turn = (rows, cos, sin)
        meta.prefills.append(seg)
        observer = c.request.retention.observer(context, slice(offset, offset + n))
        if observer is not None:
            meta.observers.append(observer)
        return context.new_slots

    def _seal(self, chunks: Seq, group: int) -> torch.Tensor | None:
        """Block ids of layer group ``group`` the step seals (a quantized store): per chunk,
        its table's blocks from ``sealed_blocks`` before the step to after it, whole key
        groups in order, less the intact ones (entries a sliding group dropped are left
        out)."""
        if not self.store.quantized:
            return None
        ids = []
        for c in chunks:
            start = c.request.num_computed_tokens
            lo = max(self.store.sealed_blocks(start), self.store.intact_blocks)
            hi = self.store.sealed_blocks(start + c.num_new_tokens)
            ids.extend(b for b in c.request.block_tables[group][lo:hi] if b >= 0)
        return torch.tensor(ids, dtype=torch.int64)

    def _context_slots(self, req, length: int, group: int = 0) -> torch.Tensor:
        """Slots [length] of positions 0..length-1 of ``req`` through its block table of
        layer group ``group`` (a ``NULL_BLOCK`` entry reads block 0)."""
        table = req.block_tables[group][: -(-length // self.block_size)]
        blocks = torch.tensor(table, dtype=torch.int64).clamp_(min=0)
        return (blocks[:, None] * self.block_size + self._offsets).flatten()[:length]


def _decode_group(start: int, contexts: list[torch.Tensor]) -> DecodeGroup:
    lengths = [len(c) for c in contexts]
    longest = max(lengths)
    if min(lengths) == longest:
        return DecodeGroup(start, len(contexts), torch.stack(contexts), None)
    slots = torch.stack([torch.cat([c, c[:1].expand(longest - len(c))]) for c in contexts])
    mask = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
    return DecodeGroup(start, len(contexts), slots, mask[:, None, None, :])


def _prefix_causal_mask(start: int, n: int) -> torch.Tensor:
    """[n, start + n] bool: new token i (position start + i) sees keys at positions <= start + i."""
    return torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]


def _wanted_rows(chunks: Seq, last_of: dict) -> torch.Tensor:
    """Rows whose logits the step returns: each chunk's last ``logit_rows(chunk)`` rows."""
    rows = []
    for c in chunks:
        last = last_of[id(c)]
        rows.extend(range(last - logit_rows(c) + 1, last + 1))
    return torch.tensor(rows, dtype=torch.int64)


def _chunk_token_ids(c) -> list[int]:
    """The tokens a chunk computes: its request's from its start, then its proposed tokens
    (``ScheduledChunk.draft``, a speculative verify)."""
    start, draft = c.request.num_computed_tokens, getattr(c, "draft", ())
    return c.request.token_ids_range(start, start + c.num_new_tokens - len(draft)) + list(draft)


def _as_tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)
