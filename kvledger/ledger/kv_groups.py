"""KV layer groups: the layers that share one block table (vLLM's KV cache groups).

A model's attention layers are grouped by kind, full, sliding-W or MLA (one latent per token,
paged as a full layer is: DeepSeek-V2's layers are all MLA, one group). Every group holds the same
number of layers, ``width = gcd`` of the kinds' layer counts (Gemma-3-1B: 4 full and 22
sliding layers, width 2: two full groups and eleven sliding ones), so one pool *page* (a
block of ``block_size`` tokens in ``width`` layers) fits every group and the groups share one
pool and one admission rule with no padding (vLLM's hybrid allocator pads instead,
``vllm/v1/core/kv_cache_utils.py``). A model of one kind is one group of all its layers: a
page is then the whole block of every layer, as before.

At length ``t`` (tokens computed) a sequence holds, per group (:func:`group_blocks`):

* full: blocks ``0 .. ceil(t / B) - 1``;
* sliding-W: the blocks covering positions ``max(0, t - W + 1) .. t - 1``, the keys its next
  query can still see (query i sees key j when i - j < W); with a chunk of C new queries, the
  positions up to ``t + C - 1`` too (:func:`window_blocks`). Leading blocks before the first
  of them (:func:`first_live_block`) go back to the pool.

:func:`sequence_blocks` is what one sequence holds, in pages: ``kvledger plan``
(``kv.kv_bytes_per_sequence``) and the engine's KV manager both count with it.

The *state* group (:class:`StateGroup`, :func:`state_group`) is the other kind: the layers
that keep a fixed state per sequence (``spec.STATE_KINDS``: gated DeltaNet, LFM2's short
convolution, Mamba-2) hold no block, but one *slot* per running sequence, the same size at
every length: per layer a convolution window ``[conv_dim, conv_kernel - 1]`` and a recurrent
state ``recurrent_shape``, in the compute dtype. A sequence holds ``sequence_blocks`` pages and
one slot; ``kv.fixed_state_bytes`` prices the slot. Pure integers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvledger.spec import FULL, MLA, SLIDING, ModelSpec


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table.

    Attributes:
        kind: ``FULL``, ``SLIDING`` or ``MLA`` (``kvledger.spec``).
        window: W of a sliding group, None for full attention.
        layers: the model's layer indices in the group, ascending.
    """

    kind: str
    window: int | None
    layers: tuple[int, ...]


def kv_groups(spec: ModelSpec) -> tuple[KVGroup, ...]:
    """The groups of ``spec``'s per-token layers, full groups first, each of ``width`` layers
    consecutive within its kind (one group of every layer when the model has one kind).
    State layers are in no block group (their fixed state is the :class:`StateGroup`)."""
    kinds = {kind: [i for i, k in enumerate(spec.layers.types) if k == kind]
             for kind in (FULL, SLIDING, MLA)}
    kinds = {kind: layers for kind, layers in kinds.items() if layers}
    width = math.gcd(*(len(layers) for layers in kinds.values())) if kinds else 0
    return tuple(KVGroup(kind, spec.layers.sliding_window if kind == SLIDING else None,
                         tuple(layers[i:i + width]))
                 for kind, layers in kinds.items() for i in range(0, len(layers), width))


@dataclass(frozen=True)
class StateGroup:
    """The state layers: one slot per sequence (module docstring).

    Attributes:
        layers: the model's state-layer indices, ascending.
        conv_shape: one layer's convolution window of one sequence, ``(conv_dim, kernel - 1)``.
        recurrent_shape: one layer's recurrent state of one sequence (``()``: none).
    """

    layers: tuple[int, ...]
    conv_shape: tuple[int, int]
    recurrent_shape: tuple[int, ...]

    def slot_elements(self) -> int:
        """Elements of one sequence's slot over every state layer."""
        recurrent = math.prod(self.recurrent_shape) if self.recurrent_shape else 0
        return len(self.layers) * (math.prod(self.conv_shape) + recurrent)


def state_group(spec: ModelSpec) -> StateGroup | None:
    """The state group of ``spec``, None when it has no state layer."""
    layers = spec.state_layers
    if not layers:
        return None
    state = spec.state
    return StateGroup(layers, (state.conv_dim, state.conv_kernel - 1), state.recurrent_shape)


def is_hybrid(groups: tuple[KVGroup, ...]) -> bool:
    """True when the groups are more than one block table (a full-and-sliding model)."""
    return len(groups) > 1


def window_blocks(tokens: int, window: int, block_size: int, new_tokens: int = 0) -> int:
    """Blocks a sliding layer of window ``W`` holds at length ``t = tokens``: those covering the
    positions its next queries can still see, ``max(0, t - W + 1) .. t + new_tokens - 1``
    (query i sees key j when i - j < W). Between steps (``new_tokens`` 0) that is up to W - 1
    positions, during a chunk of ``C = new_tokens`` queries up to W + C - 1; the blocks before
    go back to the pool (vLLM's ``SlidingWindowManager.remove_skipped_blocks``). A window
    that is not block-aligned straddles one block more than ``ceil(W / block_size)``."""
    first, last = max(0, tokens - window + 1), tokens + new_tokens - 1
    return 0 if last < first else last // block_size - first // block_size + 1


def first_live_block(group: KVGroup, tokens: int, block_size: int) -> int:
    """Index of the first block ``group`` still holds at length ``tokens``: 0 for full
    attention, the block of position ``max(0, tokens - W + 1)`` for a sliding window."""
    if group.window is None:
        return 0
    return max(0, tokens - group.window + 1) // block_size


def group_blocks(group: KVGroup, tokens: int, block_size: int, new_tokens: int = 0) -> int:
    """Blocks one sequence of ``tokens`` computed holds in ``group``, with slots for
    ``new_tokens`` more (the module docstring)."""
    if group.window is None:
        return math.ceil((tokens + new_tokens) / block_size)
    return window_blocks(tokens, group.window, block_size, new_tokens)


def sequence_blocks(groups: tuple[KVGroup, ...], tokens: int, block_size: int,
                    new_tokens: int = 0) -> int:
    """Pages one sequence holds at length ``tokens`` with slots for ``new_tokens`` more: the
    sum of :func:`group_blocks` (for one group of every layer, ``ceil((t + C) / B)``)."""
    return sum(group_blocks(g, tokens, block_size, new_tokens) for g in groups)


def peak_blocks(groups: tuple[KVGroup, ...], kv_tokens: int, block_size: int) -> int:
    """Most pages a sequence holds while it fills ``kv_tokens`` K/V slots one token a step:
    the largest ``sequence_blocks(t, 1)`` for ``t < kv_tokens`` (0 for none).

    Full groups grow with t and a sliding group's count repeats with period ``block_size``
    once ``t >= W - 1`` (and grows before), so the largest is among the last ``block_size``
    lengths."""
    if kv_tokens <= 0:
        return 0
    if not any(g.window for g in groups):
        return len(groups) * math.ceil(kv_tokens / block_size)
    return max(sequence_blocks(groups, t, block_size, 1)
               for t in range(max(0, kv_tokens - block_size), kv_tokens))


def layer_places(groups: tuple[KVGroup, ...], num_layers: int) -> tuple[tuple[int, int], ...]:
    """Per layer, (its group, its index in the group): where its K/V sit in a page. Layers in
    no group (none in a model the engine runs) take group 0, index 0."""
    places = [(0, 0)] * num_layers
    for g, group in enumerate(groups):
        for slot, layer in enumerate(group.layers):
            places[layer] = (g, slot)
    return tuple(places)


def describe_groups(groups: tuple[KVGroup, ...]) -> str:
    """E.g. ``2 full + 11 sliding-512 layer groups of 2 layers`` (logs and refusals)."""
    kinds: dict[str, int] = {}
    for g in groups:
        name = "mla" if g.kind == MLA else "full" if g.window is None else f"sliding-{g.window}"
        kinds[name] = kinds.get(name, 0) + 1
    width = len(groups[0].layers) if groups else 0
    parts = " + ".join(f"{n} {name}" for name, n in kinds.items())
    return f"{parts} layer group{'s' if len(groups) > 1 else ''} of {width} layers"
