"""QuantizedKVStore: the paged KV pool of a quantized format (fp8, int8, int4).

Per layer, one tensor per codec field (codes, scales, zero points, outliers; see
``codecs.py``) for K and one for V, each ``[num_blocks, *field shape]``: a block's scales sit
at its physical block id beside its codes and are rewritten whenever the block is.

Blocks are quantized (*sealed*) a whole key group at a time, when the step's attention
metadata lists them (``seal``: the runner applies the format's ``KVFormatSpec.sealed_blocks``,
which keeps a sequence's last tokens, KIVI's full-precision residual of R tokens, unsealed);
without a list, each block a step fills is sealed (R = G = one block). A block not yet sealed
lives in a *residual* buffer in the compute dtype: ``residual_slots`` buffers [block_size,
kv_heads, head_dim] per layer for K and V (R / block_size per running sequence).
``residual_of[block_id]`` is the buffer a block uses (-1: sealed or unused). A step stages the
blocks it writes or seals (buffer + new tokens), encodes the sealed ones from there and
releases their buffers; a block freed unsealed releases its buffer too (``release``, called by
the block pool). A sequence's first ``intact_blocks`` (``KVFormatSpec.intact_tokens``) are
never sealed: they keep their buffers for as long as they are in a block table or in the
prefix cache (the pool releases a cached block when it evicts it). A key group of k > 1 blocks (``GroupedKeys``) splits its scales over its
blocks: ``group_members[block_id]`` (bookkeeping) holds the k block ids of the group the block
was sealed in, read to decode it. A prefill step's queries read the blocks it writes as they
were staged (``step_blocks``: its own tokens as computed, the blocks' earlier tokens from
their buffers) and every other block from the pool; decodes read the pool.

With a rotation ``R`` (``rotation.py``) the store holds ``k R`` and ``v R``: a step's K/V are
rotated once as they are written (before the residual buffer and the encoder), and
``read_blocks`` / ``gather`` rotate back, so every reader but the native kernel (which rotates
queries and output instead) sees the unrotated K/V.

Every tensor is allocated with ``lazy_zeros`` (anonymous memory mapped on first write), so
blocks never used cost no RAM, as in the full-precision store. The bytes (``nbytes``) are the
codec tensors plus the residual buffers; ``residual_of`` and the
free list are bookkeeping, like block tables, and are not KV bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from kvledger.engine.kv.codec_numbers import codec_numbers
from kvledger.engine.kv.codecs import BlockCodec
from kvledger.engine.kv.store import StepBlocks, distinct, group_layout, lazy_zeros
from kvledger.ledger.kv_format import KVFormatSpec

if TYPE_CHECKING:
    from kvledger.device import Kernels


class _WritePlan(NamedTuple):
    """Where one step's tokens go (indices into the step's distinct blocks, or row indices)."""

    blocks: int  # distinct blocks the step writes or seals
    written: torch.Tensor  # ids of the blocks it writes (ascending), and their staged rows
    written_rows: torch.Tensor
    staged_rows: torch.Tensor  # token -> row of the staged blocks [blocks * bs]
    buffer_rows: torch.Tensor  # token -> row of the residual buffers (when none is sealed)
    filled: torch.Tensor  # staged blocks sealed now (whole key groups in order), their ids
    filled_ids: torch.Tensor
    kept: torch.Tensor  # staged blocks still unsealed, and their buffers
    kept_buffers: torch.Tensor
    had: torch.Tensor  # staged blocks that had a buffer before the step, and which
    had_buffers: torch.Tensor
    opened: torch.Tensor  # buffers taken by this step


def _where(mask: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(mask).flatten()


class QuantizedKVStore:
    """Quantized per-layer K/V blocks with full-precision residual blocks.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: shape of the pool.
        kv_format: fp8, int8, int4, int3 or int2 (for logs and stats).
        key_codecs: one codec per layer, or one for all; value_codec: one for all layers.
        compute_dtype: dtype of the residual blocks and of what reads return.
        residual_slots: most unsealed blocks at once (the engine's ``max_num_seqs`` x the
            layer groups x the window's R / block_size blocks).
        kernels: the device's kernels (``kvledger.device.Kernels``): filled int blocks are
            encoded by its KV encoder (``kv_encoder``, same bytes) when it has one; None: the
            codecs' PyTorch code encodes.
        rotation: [head_dim, head_dim] fp32 orthogonal matrix the rows are stored rotated by,
            or None.
        device: where every tensor lives (None: the CPU, ``lazy_zeros``).
        fmt: the format's spec, whose ``sealed_blocks`` rule the runner applies (None: the
            defaults of ``kv_format``, R = G = one block).
    """

    quantized = lossy = True

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, kv_format: str, key_codecs: list[BlockCodec] | BlockCodec,
                 value_codec: BlockCodec, compute_dtype: torch.dtype,
                 residual_slots: int, kernels: Kernels | None = None,
                 places: tuple[tuple[int, int], ...] | None = None,
                 rotation: torch.Tensor | None = None, fmt: KVFormatSpec | None = None,
                 device: torch.device | None = None) -> None:
        self.block_size, self.num_blocks, self.kv_format = block_size, num_blocks, kv_format
        self.num_kv_heads = num_kv_heads
        self.compute_dtype = compute_dtype
        if not isinstance(key_codecs, list):
            key_codecs = [key_codecs] * num_layers
        self.key_codecs, self.value_codec = key_codecs, value_codec
        # layers at the same index of different groups share tensors (store.py); per-layer
        # key codecs keep their own fields' shapes, which outlier counts make equal
        self.group_of_layer, index = group_layout(num_layers, places)
        self.device = device or torch.device("cpu")
        width = max(index) + 1
        shape = (residual_slots, block_size, num_kv_heads, head_dim)
        keys = [self._alloc(key_codecs[index.index(i)]) for i in range(width)]
        values = [self._alloc(value_codec) for _ in range(width)]
        res_k = [lazy_zeros(shape, compute_dtype, device) for _ in range(width)]
        res_v = [lazy_zeros(shape, compute_dtype, device) for _ in range(width)]
        self.key_parts, self.value_parts = [keys[i] for i in index], [values[i] for i in index]
        self.residual_keys = [res_k[i] for i in index]
        self.residual_values = [res_v[i] for i in index]
        self.residual_of = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self._free_residuals = list(range(residual_slots))
        self._num_groups = 1 if self.group_of_layer is None else len(set(self.group_of_layer))
        self._plans: list[tuple[torch.Tensor, _WritePlan]] = []  # this step's, per group
        self._step: tuple[int, torch.Tensor, StepBlocks] | None = None  # the last write's
        self._encoder = None if kernels is None else kernels.kv_encoder()
        self.rotation = None if rotation is None else rotation.to(self.device)
        self.fmt = fmt or KVFormatSpec(kv_format)
        self.key_group_blocks = key_codecs[0].group_blocks
        self.intact_blocks = self.fmt.intact_blocks(block_size)
        self.group_members = torch.zeros((num_blocks, self.key_group_blocks), dtype=torch.int64,
                                         device=device)

    def _alloc(self, codec: BlockCodec) -> dict[str, torch.Tensor]:
        return {name: lazy_zeros((self.num_blocks, *shape), dtype, self.device)
                for name, (shape, dtype) in codec.fields().items()}

    @property
    def nbytes(self) -> int:
        """Bytes of every codec tensor and residual buffer (what the ledger predicts)."""
        parts = [t for layer in distinct(self.key_parts + self.value_parts)
                 for t in layer.values()]
        return sum(t.nbytes for t in parts + distinct(self.residual_keys + self.residual_values))

    def release(self, block_id: int) -> None:
        """Block ``block_id`` left every block table: drop its residual buffer, if any."""
        slot = int(self.residual_of[block_id])
        if slot >= 0:
            self.residual_of[block_id] = -1
            self._free_residuals.append(slot)

    def open_buffers(self, block_ids: list[int]) -> list[int]:
        """Give blocks ``block_ids`` (holding none) a residual buffer each, in order, as many
        as are free (a KV tier restoring intact blocks); returns the buffers' slots."""
        slots = [self._free_residuals.pop()
                 for _ in range(min(len(block_ids), len(self._free_residuals)))]
        if slots:
            self.residual_of[torch.tensor(block_ids[:len(slots)])] = torch.tensor(slots)
        return slots

    def shareable(self, blocks: list[int]) -> int:
        """Leading blocks of a prefix-cache hit ``blocks`` (from position 0) that another
        sequence may share: the intact blocks (each whole in its buffer), then whole key
        groups, each sealed together (``group_members`` of its k blocks are those k blocks).
        A block's scales sit in its group's other blocks, which the prefix cache evicts one
        at a time, and a hit may pair blocks of different sealings (the same tokens cached
        twice): the hit ends before such a group."""
        k, n = self.key_group_blocks, self.intact_blocks
        if k == 1 or len(blocks) <= n:
            return len(blocks)
        rest = blocks[n:]
        ids = torch.tensor(rest[: len(rest) // k * k], dtype=torch.int64,
                           device=self.device).view(-1, k)
        whole = (self.group_members[ids] == ids[:, None, :]).flatten(1).all(1)
        return n + k * int(whole.cumprod(0).sum())

    def sealed_blocks(self, tokens: int) -> int:
        """Leading blocks of a sequence of ``tokens`` tokens that are sealed (the format's
        ``KVFormatSpec.sealed_blocks``: the runner seals them, the prefix cache shares only
        them)."""
        return self.fmt.sealed_blocks(tokens, self.block_size)

    def _seal_ids(self, written: torch.Tensor, last: torch.Tensor,
                  seal: torch.Tensor | None) -> torch.Tensor:
        """Block ids a step seals that writes blocks ``written`` (sorted) up to offsets
        ``last``: when ``seal`` is None, the blocks it fills, whole key groups of consecutive
        ones in id order (a direct write of a run of slots); else those of ``seal`` unsealed or
        written now (a block a prefix-cache hit brought is sealed already)."""
        k = self.key_group_blocks
        if seal is None:
            filled = written[last == self.block_size - 1]
            return filled[: len(filled) // k * k]
        todo = ((self.residual_of[seal] >= 0) | torch.isin(seal, written)).view(-1, k)
        assert bool((todo.all(1) | ~todo.any(1)).all()), "a key group is sealed whole"
        return seal[todo.flatten()]

    def _write_plan(self, slot_mapping: torch.Tensor, seal: torch.Tensor | None) -> _WritePlan:
        """Which blocks a step's slots write and seal, and where unsealed ones go; computed
        once per step and layer group (the same ``slot_mapping`` object is passed for every
        layer of a group)."""
        for key, plan in self._plans:
            if key is slot_mapping:
                return plan
        bs = self.block_size
        blocks, offsets = slot_mapping // bs, slot_mapping % bs
        written, inverse = torch.unique(blocks, return_inverse=True)
        last = torch.full_like(written, -1).scatter_reduce_(0, inverse, offsets, "amax")
        seal_ids = self._seal_ids(written, last, seal)
        uniq = torch.unique(torch.cat([written, seal_ids]))
        inverse = torch.searchsorted(uniq, blocks)
        full = torch.isin(uniq, seal_ids)
        old = self.residual_of[uniq]
        new = old.clone()
        # the buffers of blocks this step seals are free first: a chunk that seals a block
        # and opens the next reuses its buffer (write() reads every old buffer before it
        # writes any new one)
        self._free_residuals += old[full & (old >= 0)].tolist()
        for i in torch.nonzero(~full & (old < 0)).flatten().tolist():
            assert self._free_residuals, "more unsealed KV blocks than residual buffers"
            new[i] = self._free_residuals.pop()
        new[full] = -1
        self.residual_of[uniq] = new
        if self.key_group_blocks > 1 and len(seal_ids):
            groups = seal_ids.view(-1, self.key_group_blocks)
            self.group_members.index_copy_(
                0, seal_ids, groups.repeat_interleave(self.key_group_blocks, 0))
        kept, had = _where(~full), _where(old >= 0)
        plan = _WritePlan(len(uniq), written, torch.searchsorted(uniq, written),
                          inverse * bs + offsets, new[inverse] * bs + offsets,
                          torch.searchsorted(uniq, seal_ids), seal_ids, kept, new[kept], had,
                          old[had], new[_where(old < 0)])
        keep = self._num_groups - 1  # the other groups' plans of this step
        self._plans = (self._plans[-keep:] if keep else []) + [(slot_mapping, plan)]
        return plan

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, seal: torch.Tensor | None = None) -> None:
        """Store new tokens' K and V ([tokens, kv_heads, head_dim]) at ``slot_mapping`` and
        seal blocks ``seal`` (int64 ids, whole key groups in order; None: the blocks the step
        fills, ``_seal_ids``): sealed blocks are quantized whole, the others kept in their
        buffer.

        Only ``index_select`` / ``index_copy_`` move rows: PyTorch's advanced indexing
        (``x[idx]``, ``x[idx] = y``) is far slower on CPU with two threads (measured: ~8 ms
        against 0.01-0.03 ms for an [8, 16, 3, 64] bf16 tensor, load ~10), and this runs for
        K and V of every layer at every step."""
        plan = self._write_plan(slot_mapping, seal)
        self._step, staged_kv = None, []
        for x, parts, codec, residual in (
                (key, self.key_parts[layer], self.key_codecs[layer], self.residual_keys[layer]),
                (value, self.value_parts[layer], self.value_codec,
                 self.residual_values[layer])):
            x = self._rotated(x, self.rotation)
            if not len(plan.filled):  # each token straight into its block's buffer
                if len(plan.opened):  # a newly opened buffer starts as zeros
                    residual.index_fill_(0, plan.opened, 0)
                residual.view(-1, *residual.shape[2:]).index_copy_(0, plan.buffer_rows, x)
                continue
            staged = torch.zeros((plan.blocks, *residual.shape[1:]), dtype=self.compute_dtype,
                                 device=residual.device)
            if len(plan.had):
                staged.index_copy_(0, plan.had, residual.index_select(0, plan.had_buffers))
            staged.view(-1, *residual.shape[2:]).index_copy_(0, plan.staged_rows, x)
            filled = staged.index_select(0, plan.filled)
            if not self._encode_natively(codec, filled, parts, plan.filled_ids):
                for name, tensor in codec.encode(filled).items():
                    parts[name].index_copy_(0, plan.filled_ids, tensor)
            if len(plan.kept):
                residual.index_copy_(0, plan.kept_buffers, staged.index_select(0, plan.kept))
            staged_kv.append(staged if len(plan.written) == plan.blocks
                             else staged.index_select(0, plan.written_rows))
        if staged_kv:
            self._step = (layer, slot_mapping, StepBlocks(plan.written, *staged_kv,
                                                          self.rotation))

    def step_blocks(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor) -> StepBlocks | None:
        """The blocks the last :meth:`write` (of ``layer`` at ``slot_mapping``) wrote, as they
        were staged before any was encoded: the step's own rows as computed (rotated and in
        the compute dtype, as a residual buffer holds them), the blocks' earlier rows from
        their buffers; None when the step sealed nothing (every row it wrote is in a residual
        buffer). A block it sealed without writing is read from the pool, sealed. ``key`` and ``value`` are not read again: the staged rows hold them."""
        step = self._step
        if step is None or step[0] != layer or step[1] is not slot_mapping:
            return None
        return step[2]

    def _encode_natively(self, codec: BlockCodec, filled: torch.Tensor,
                         parts: dict[str, torch.Tensor], block_ids: torch.Tensor) -> bool:
        """Whether the device's encoder wrote ``filled`` into ``parts`` at ``block_ids`` (an
        int codec of one block per group, a dtype and layout it takes)."""
        numbers = None if self._encoder is None else codec_numbers(codec)
        if numbers is None or numbers.kind != "int" or numbers.grouped:
            return False
        return self._encoder.encode_into(filled, parts, block_ids, bits=numbers.bits,
                                         group=numbers.group, centred=numbers.centred,
                                         min_scale=numbers.min_scale, channels=numbers.channels)

    def read_blocks(self, layer: int, block_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of blocks ``block_ids`` (any shape S) -> S + [bs, kv_heads, D]
        each, in the compute dtype; an unsealed block comes from its residual buffer."""
        flat = block_ids.reshape(-1)
        slots = self.residual_of[flat]
        partial = _where(slots >= 0)
        out = []
        for parts, codec, residual in (
                (self.key_parts[layer], self.key_codecs[layer], self.residual_keys[layer]),
                (self.value_parts[layer], self.value_codec, self.residual_values[layer])):
            x = codec.decode(self._parts_of(parts, codec, flat), self.compute_dtype)
            if len(partial):
                x.index_copy_(0, partial, residual.index_select(0, slots[partial]))
            x = self._rotated(x, None if self.rotation is None else self.rotation.T)
            out.append(x.view(*block_ids.shape, *x.shape[1:]))
        return out[0], out[1]

    def _parts_of(self, parts: dict[str, torch.Tensor], codec: BlockCodec,
                  flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Blocks ``flat``'s tensors per field; a key group's split fields gathered over the
        group's blocks ([n, k, *slice])."""
        out = {n: t.index_select(0, flat) for n, t in parts.items()
               if n not in codec.group_fields}
        if codec.group_fields:
            members = self.group_members.index_select(0, flat).reshape(-1)
            for name in codec.group_fields:
                t = parts[name].index_select(0, members)
                out[name] = t.view(len(flat), codec.group_blocks, *t.shape[1:])
        return out

    def _rotated(self, x: torch.Tensor, matrix: torch.Tensor | None) -> torch.Tensor:
        """Rows of ``x`` [..., head_dim] times ``matrix`` (in fp32), in the compute dtype."""
        if matrix is None:
            return x.to(self.compute_dtype)
        return (x.float() @ matrix).to(self.compute_dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape S) -> S + [kv_heads, head_dim], compute dtype
        (each block touched is dequantized once)."""
        blocks, inverse = torch.unique(slots // self.block_size, return_inverse=True)
        keys, values = self.read_blocks(layer, blocks)
        rows = (inverse * self.block_size + slots % self.block_size).reshape(-1)
        tail = keys.shape[2:]
        return tuple(x.reshape(-1, *tail).index_select(0, rows).view(*slots.shape, *tail)
                     for x in (keys, values))
