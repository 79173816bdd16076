"""KV-cache bytes per token, per block and per sequence, for every layer kind and KV format.

What one token stores in one layer (seed §2.1-§2.2, §5.2):

  ``full_attention`` / ``sliding_attention``  K and V: ``2 x kv_heads x head_dim`` elements
  ``mla``      one latent of ``kv_lora_rank + qk_rope_head_dim`` elements, shared by K and V
               (DeepSeek-V2, arXiv:2405.04434 §2.1.2: the compressed ``c_KV`` plus the decoupled
               RoPE key ``k_R``; counting it as K+V or as GQA heads is the classic mistake)
  ``linear_attention`` / ``conv`` / ``mamba``  nothing per token; a fixed per-sequence state
               (gated DeltaNet, LFM2's short convolution, Mamba-2: :func:`fixed_state_bytes`)

A sliding layer keeps at most ``sliding_window`` tokens; in the window-aware mode (a hybrid
allocator) it is capped there, in whole blocks the blocks its next queries can still see
(``kv_groups.group_blocks``, what the engine's KV manager holds), otherwise it is sized as full attention (what an engine without a
hybrid allocator reserves).

Every function takes ``(spec, fmt, tp, block_size)``: the model, the KV format with its options
(:class:`~kvledger.ledger.kv_format.KVFormatSpec`, whose module gives each format's layout), the
tensor-parallel ranks and the tokens per block. K and V of attention layers are priced per
*block* of ``block_size`` tokens and KV head (:func:`head_block_bytes`); per token, a format
costs its block's bytes / block size, rounded up (metadata per block does not divide evenly). A
quantized engine also keeps each running sequence's window of recent blocks in the compute
dtype (:func:`residual_bytes`). An MLA latent is priced per vector (:func:`vector_bytes`), groups
along the latent, no per-block scale; the engine runs MLA in the full-precision formats
(``engine/kv/latent_store.py``), a quantized latent is a planner figure only.

Tensor parallelism: a rank holds ``kv_heads / tp`` KV heads, or one replicated head when
``kv_heads < tp``; an MLA latent is replicated on every rank; a linear-attention state is split.

All results are integers of bytes. No torch here.
"""

from __future__ import annotations

import math

from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv_format import (
    FP16_BYTES,
    FP32_BYTES,
    PACK_CHANNELS,
    KVFormatSpec,
    resolve_group_size,
)
from kvledger.ledger.kv_groups import group_blocks, is_hybrid, kv_groups
from kvledger.spec import FULL, MLA, SLIDING, STATE_KINDS, ModelSpec


def head_block_bytes(spec: ModelSpec, fmt: KVFormatSpec, block_size: int) -> int:
    """Bytes of K + V of one KV head in one attention layer for one block, as the engine
    stores them.

    Raises:
        InvalidParameterError: bad group size, key group or outlier count, outliers on a
            full-precision format, int4 with an odd head_dim.
    """
    f, head_dim = fmt.storage, spec.head_dim
    outliers = fmt.outlier_count(head_dim)
    if not f.quantized:
        if outliers:
            raise InvalidParameterError(
                f"outlier channels apply to quantized KV formats (fp8, int8, int4), not {f.name}")
        return 2 * block_size * head_dim * f.bits // 8
    unit = PACK_CHANNELS.get(f.bits, 1)
    if head_dim % unit:
        raise InvalidParameterError(
            f"{f.name} KV needs a head_dim that is a multiple of {unit}, got {head_dim}")
    codes = block_size * head_dim * f.bits // 8
    if f.name == "fp8":
        meta_k = meta_v = FP32_BYTES
    else:
        g = resolve_group_size(fmt.group_size, head_dim)
        meta_v = block_size * (head_dim // g) * f.group_meta_bytes
        meta_k = meta_v
        if fmt.key_quant == "per-channel":  # a key group's scales, D / k channels per block
            k = fmt.key_group_blocks(block_size)
            if head_dim % k:
                raise InvalidParameterError(
                    f"a key group of {k} blocks splits its head_dim {head_dim} channels' "
                    f"scales over its blocks: head_dim must be a multiple of {k}")
            meta_k = head_dim // k * f.group_meta_bytes
    return 2 * codes + meta_k + meta_v + block_size * outliers * FP16_BYTES


def vector_bytes(length: int, fmt: KVFormatSpec) -> int:
    """Bytes of one cached vector of ``length`` elements (the MLA latent): groups of
    ``fmt.group_size`` along it (None = the whole vector), ``fmt.outlier_frac`` of it in fp16.

    Raises:
        InvalidParameterError: bad group size or outlier fraction; a rotation.
    """
    f, group_size, outlier_frac = fmt.storage, fmt.group_size, fmt.outlier_frac
    if fmt.rotation != "none":
        raise InvalidParameterError(f"--kv-rotation {fmt.rotation} is not supported on MLA "
                                    "layers (untested there)")
    if group_size is not None and group_size <= 0:
        raise InvalidParameterError(f"--kv-group-size must be positive, got {group_size}")
    if not 0.0 <= outlier_frac < 1.0:
        raise InvalidParameterError(f"--kv-outlier-frac must be in [0, 1), got {outlier_frac}")
    if outlier_frac and not f.quantized:
        raise InvalidParameterError(
            f"--kv-outlier-frac applies to quantized KV formats (fp8, int8, int4), not {f.name}"
        )
    outliers = math.ceil(outlier_frac * length)
    body = length - outliers
    groups = math.ceil(body / (group_size or length)) if f.group_meta_bytes and body else 0
    return math.ceil(body * f.bits / 8) + groups * f.group_meta_bytes + outliers * FP16_BYTES


def layer_block_bytes(spec: ModelSpec, fmt: KVFormatSpec, tp: int, block_size: int,
                      layer_kind: str) -> int:
    """Bytes one block of ``block_size`` tokens holds in one layer of ``layer_kind``.

    Full/sliding: ``kv_heads_per_rank x head_block_bytes``; MLA: ``block_size`` latents of
    :func:`vector_bytes`; a state layer: 0.
    """
    if layer_kind in (FULL, SLIDING):
        return kv_heads_per_rank(spec, tp) * head_block_bytes(spec, fmt, block_size)
    if layer_kind == MLA:
        latent = spec.latent.kv_lora_rank + spec.latent.qk_rope_head_dim
        return block_size * vector_bytes(latent, fmt)
    if layer_kind in STATE_KINDS:
        return 0
    raise ValueError(f"unknown layer kind {layer_kind!r}")


def kv_heads_per_rank(spec: ModelSpec, tp: int = 1) -> int:
    """KV heads one tensor-parallel rank holds (replicated to 1 when ``kv_heads < tp``).

    Raises:
        InvalidParameterError: ``tp`` does not divide the query heads, or neither divides the
            other for the KV heads.
    """
    if tp <= 0:
        raise InvalidParameterError(f"--tensor-parallel-size must be positive, got {tp}")
    heads, kv = spec.num_attention_heads, spec.num_kv_heads
    if heads % tp or (kv % tp and tp % kv):
        raise InvalidParameterError(
            f"--tensor-parallel-size {tp} does not divide the model's heads ({heads} query, {kv} KV heads)"
        )
    return max(kv // tp, 1)


def layer_bytes_per_token(spec: ModelSpec, fmt: KVFormatSpec, tp: int, block_size: int,
                          layer_kind: str) -> int:
    """Bytes one token stores in one layer of ``layer_kind`` (0 for a state layer): the
    layer's :func:`layer_block_bytes` / ``block_size``, rounded up (exact for the
    full-precision formats: ``2 x kv_heads_per_rank x head_dim x element bytes``)."""
    return -(-layer_block_bytes(spec, fmt, tp, block_size, layer_kind) // block_size)


def kv_bytes_per_token(spec: ModelSpec, fmt: KVFormatSpec, tp: int, block_size: int,
                       window_aware: bool = False) -> int:
    """Bytes of KV one token adds, summed over the layers that store per-token KV.

    With ``window_aware=False`` (the JSON contract's ``kv_bytes_per_token``) every full, sliding
    and MLA layer counts. With ``window_aware=True`` sliding layers are left out: the figure is
    the growth per token once the context is past every window.
    """
    return sum(
        layer_bytes_per_token(spec, fmt, tp, block_size, kind)
        for kind in spec.layers.types
        if not (window_aware and kind == SLIDING)
    )


def kv_bytes_per_block(spec: ModelSpec, fmt: KVFormatSpec, tp: int, block_size: int) -> int:
    """Bytes one paged-KV block of ``block_size`` token slots holds across all per-token layers:
    exactly the bytes of the engine's pool tensors per block (codes, scales, zero points and
    outliers for a quantized format; ``block_size x layers x 2 x kv_heads x head_dim x element
    bytes`` for fp32/fp16/bf16).

    Raises:
        InvalidParameterError: ``block_size <= 0``, or a bad layout option.
    """
    if block_size <= 0:
        raise InvalidParameterError(f"--block-size must be positive, got {block_size}")
    return sum(layer_block_bytes(spec, fmt, tp, block_size, kind) for kind in spec.layers.types)


def residual_bytes(spec: ModelSpec, fmt: KVFormatSpec, tp: int, block_size: int,
                   compute_format: str) -> int:
    """Bytes a quantized format keeps per running sequence at full precision, in the compute
    format ``compute_format``: its ``reserved_blocks`` (the window of ``residual_blocks``, by
    default the key group: the last, partial block for int8 / int4; and twice the intact
    blocks, the sequence's and a cached one's).
    0 for a full-precision format.

    Raises:
        InvalidParameterError: residual tokens not a multiple of ``block_size`` or below the
            key group.
    """
    if not fmt.quantized:
        return 0
    blocks = fmt.reserved_blocks(block_size)
    return blocks * kv_bytes_per_block(spec, KVFormatSpec(compute_format), tp, block_size)


def layer_tokens(spec: ModelSpec, layer_kind: str, tokens: int, window_aware: bool) -> int:
    """Tokens a layer keeps for a sequence of ``tokens``: capped at the window when sliding."""
    if window_aware and layer_kind == SLIDING and spec.layers.sliding_window:
        return min(tokens, spec.layers.sliding_window)
    return tokens


def kv_bytes_per_sequence(spec: ModelSpec, fmt: KVFormatSpec, tp: int, block_size: int,
                          tokens: int, window_aware: bool = True, paged: bool = False) -> int:
    """Bytes of per-token KV one sequence of ``tokens`` holds (fixed state excluded).

    Args:
        tokens: sequence length (prompt + generated), >= 0.
        window_aware: cap sliding layers at their window (hybrid allocator) or not.
        paged: each layer holds whole blocks of :func:`layer_block_bytes`, as a paged engine
            allocates (a window-aware sliding layer: ``kv_groups.group_blocks``); else tokens x
            :func:`layer_bytes_per_token` (the block's metadata spread per token).

    See :func:`fixed_state_bytes` for the per-sequence state of linear-attention layers and
    :func:`residual_bytes` for a quantized engine's partial block.
    """
    if tokens < 0:
        raise InvalidParameterError(f"token count must be >= 0, got {tokens}")
    held = {}  # layer -> blocks, for the layers the engine's KV manager pages by group
    if paged and window_aware:
        held = {layer: group_blocks(g, tokens, block_size)
                for g in kv_groups(spec) for layer in g.layers}
    total = 0
    for layer, kind in enumerate(spec.layers.types):
        if paged:
            blocks = held.get(layer, math.ceil(tokens / block_size))
            total += blocks * layer_block_bytes(spec, fmt, tp, block_size, kind)
        else:
            kept = layer_tokens(spec, kind, tokens, window_aware)
            total += kept * layer_bytes_per_token(spec, fmt, tp, block_size, kind)
    return total


def kv_bytes_per_page(spec: ModelSpec, fmt: KVFormatSpec, tp: int, block_size: int) -> int:
    """Bytes of one page of the engine's pool: a block of ``block_size`` tokens in one layer
    group (``kv_groups``), :func:`kv_bytes_per_block` when the model is one group.

    Raises:
        InvalidParameterError: see :func:`kv_bytes_per_block`.
    """
    groups = kv_groups(spec)
    if not is_hybrid(groups):
        return kv_bytes_per_block(spec, fmt, tp, block_size)
    return sum(layer_block_bytes(spec, fmt, tp, block_size, spec.layers.types[layer])
               for layer in groups[0].layers)


def fixed_state_bytes(
    spec: ModelSpec, state_bytes_per_element: int = FP16_BYTES, tp: int = 1
) -> int:
    """Bytes of the fixed per-sequence state of all state layers (``STATE_KINDS``: gated
    DeltaNet, short convolution, Mamba-2; 0 if none), per tensor-parallel rank (the state is
    split by heads across ranks): per layer, the convolution's window of ``conv_kernel - 1``
    inputs over ``conv_dim`` channels plus the recurrent state (``spec.state``).

    The state does not grow with the context and is kept in the activation dtype (bf16 by
    default, the engine's compute dtype: ``kv_groups.state_group``) whatever the KV format.
    """
    layers = len(spec.state_layers)
    if not layers:
        return 0
    return math.ceil(layers * spec.state.elements * state_bytes_per_element / tp)


def checkpoint_interval_blocks(state_bytes: int, page_bytes: int) -> int:
    """Blocks between two state checkpoints of a sequence (prefix caching on a model with
    state layers): the fewest whose KV bytes reach the state's, so checkpoints never hold
    more than the KV they let a hit skip (at least 1: one per block for a small state)."""
    return max(1, -(-state_bytes // max(page_bytes, 1)))
