"""KV-cache bytes per token, per block and per sequence, for every layer kind and KV format.

What one token stores in one layer (seed §2.1-§2.2, §5.2):

  ``full_attention`` / ``sliding_attention``  K and V: ``2 x kv_heads x head_dim`` elements
  ``mla``      one latent of ``kv_lora_rank + qk_rope_head_dim`` elements, shared by K and V
               (DeepSeek-V2, arXiv:2405.04434 §2.1.2: the compressed ``c_KV`` plus the decoupled
               RoPE key ``k_R``; counting it as K+V or as GQA heads is the classic mistake)
  ``linear_attention``  nothing per token; a fixed per-sequence state (Qwen3-Next Gated DeltaNet)

A sliding layer keeps at most ``sliding_window`` tokens; in the window-aware mode (a hybrid
allocator) it is capped there, otherwise it is sized as full attention (what an engine without a
hybrid allocator reserves).

KV formats (seed §4.2), in the layout the engine stores (``engine/kv/codecs.py``). K and V of
attention layers are priced per *block* of ``block_size`` tokens and KV head
(:func:`head_block_bytes`):

  fp32 / fp16 / bf16   4 / 2 / 2 bytes per element, no metadata
  fp8 (e4m3)           1 byte per element + one fp32 scale per block and KV head, for K and V
  int8 / int4          8 / 4 bits per element (int4: two per byte) + an fp16 scale and an fp16
                       zero point per group (asymmetric). Values: groups of ``group_size``
                       along head_dim, per token. Keys ``per-channel`` (default, KIVI): one
                       group per channel over the block's tokens; or ``per-token`` like values.
  outliers             ``n`` key channels per layer and KV head also kept in fp16 (2 bytes per
                       token each); the codes still cover every channel. Channel indices are
                       calibrated once per layer, so they cost no bytes per block.

Per token, a quantized format costs its block's bytes / block size, rounded up (metadata per
block does not divide evenly). A quantized engine also keeps each running sequence's last,
partial block in the compute dtype (:func:`residual_bytes`). An MLA latent is priced per
vector (:func:`vector_bytes`), groups along the latent, no per-block scale: a planner figure
only, the engine does not run MLA.

Tensor parallelism: a rank holds ``kv_heads / tp`` KV heads, or one replicated head when
``kv_heads < tp``; an MLA latent is replicated on every rank; a linear-attention state is split.

All results are integers of bytes. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvledger.errors import InvalidParameterError
from kvledger.spec import FULL, LINEAR, MLA, SLIDING, ModelSpec

KV_FORMATS = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")

FP16_BYTES = 2


@dataclass(frozen=True)
class KVFormat:
    """Storage layout of one KV format.

    Attributes:
        name: one of :data:`KV_FORMATS`.
        bits: bits per stored element.
        group_meta_bytes: bytes of scale (+ zero point) per quantization group; 0 when the
            format has no per-group metadata.
    """

    name: str
    bits: int
    group_meta_bytes: int

    @property
    def quantized(self) -> bool:
        """True for the formats below 16 bits (fp8, int8, int4)."""
        return self.bits < 16


_FORMATS = {
    "fp32": KVFormat("fp32", 32, 0),
    "fp16": KVFormat("fp16", 16, 0),
    "bf16": KVFormat("bf16", 16, 0),
    "fp8": KVFormat("fp8", 8, 0),
    "int8": KVFormat("int8", 8, 2 * FP16_BYTES),
    "int4": KVFormat("int4", 4, 2 * FP16_BYTES),
}
FP32_BYTES = 4
DEFAULT_GROUP_SIZE = 32
KEY_QUANT_MODES = ("per-channel", "per-token")


def resolve_group_size(group_size: int | None, head_dim: int) -> int:
    """The group along head_dim: ``group_size``, or by default 32 (head_dim if 32 does not
    divide it).

    Raises:
        InvalidParameterError: a group size <= 0 or one that does not divide head_dim.
    """
    if group_size is None:
        return DEFAULT_GROUP_SIZE if head_dim % DEFAULT_GROUP_SIZE == 0 else head_dim
    if group_size <= 0 or head_dim % group_size:
        raise InvalidParameterError(
            f"--kv-group-size {group_size} must be positive and divide head_dim {head_dim}")
    return group_size


def outlier_count(head_dim: int, outlier_channels: int | None, outlier_frac: float) -> int:
    """Key channels kept in fp16: ``outlier_channels``, else ``ceil(outlier_frac x head_dim)``.

    Raises:
        InvalidParameterError: negative, or not fewer than head_dim.
    """
    n = math.ceil(outlier_frac * head_dim) if outlier_channels is None else outlier_channels
    if not 0 <= n < head_dim:
        raise InvalidParameterError(
            f"--kv-outlier-channels must be in [0, head_dim {head_dim}), got {n}")
    return n


def head_block_bytes(block_size: int, head_dim: int, fmt: str, group_size: int | None = None,
                     key_quant: str = "per-channel", outliers: int = 0) -> int:
    """Bytes of K + V of one KV head in one layer for one block, as the engine stores them.

    Raises:
        InvalidParameterError: unknown format or key mode, bad group size, outliers on a
            full-precision format, int4 with an odd head_dim.
    """
    f = kv_format(fmt)
    if key_quant not in KEY_QUANT_MODES:
        raise InvalidParameterError(
            f"--kv-key-quant must be one of {', '.join(KEY_QUANT_MODES)}, got {key_quant!r}")
    if not f.quantized:
        if outliers:
            raise InvalidParameterError(
                f"outlier channels apply to quantized KV formats (fp8, int8, int4), not {fmt}")
        return 2 * block_size * head_dim * f.bits // 8
    if f.bits == 4 and head_dim % 2:
        raise InvalidParameterError(f"int4 KV needs an even head_dim, got {head_dim}")
    codes = block_size * head_dim * f.bits // 8
    if fmt == "fp8":
        meta_k = meta_v = FP32_BYTES
    else:
        g = resolve_group_size(group_size, head_dim)
        meta_v = block_size * (head_dim // g) * f.group_meta_bytes
        meta_k = head_dim * f.group_meta_bytes if key_quant == "per-channel" else meta_v
    return 2 * codes + meta_k + meta_v + block_size * outliers * FP16_BYTES


def kv_format(name: str) -> KVFormat:
    """Look up a KV format by name.

    Raises:
        InvalidParameterError: unknown name (the message lists the known ones).
    """
    try:
        return _FORMATS[name]
    except KeyError:
        raise InvalidParameterError(
            f"unknown KV format {name!r}; choose one of {', '.join(KV_FORMATS)}"
        ) from None


_lookup = kv_format


def vector_bytes(
    length: int, fmt: str, group_size: int | None = None, outlier_frac: float = 0.0
) -> int:
    """Bytes of one cached vector of ``length`` elements in format ``fmt``.

    Args:
        length: elements in the vector (``head_dim`` for a K or V head, the latent for MLA).
        fmt: KV format name.
        group_size: elements per quantization group (int8/int4); None = the whole vector.
        outlier_frac: fraction of channels kept in fp16 (quantized formats only), in [0, 1).

    Raises:
        InvalidParameterError: bad group size or outlier fraction, unknown format.
    """
    f = kv_format(fmt)
    if group_size is not None and group_size <= 0:
        raise InvalidParameterError(f"--kv-group-size must be positive, got {group_size}")
    if not 0.0 <= outlier_frac < 1.0:
        raise InvalidParameterError(f"--kv-outlier-frac must be in [0, 1), got {outlier_frac}")
    if outlier_frac and not f.quantized:
        raise InvalidParameterError(
            f"--kv-outlier-frac applies to quantized KV formats (fp8, int8, int4), not {fmt}"
        )
    outliers = math.ceil(outlier_frac * length)
    body = length - outliers
    groups = math.ceil(body / (group_size or length)) if f.group_meta_bytes and body else 0
    return math.ceil(body * f.bits / 8) + groups * f.group_meta_bytes + outliers * FP16_BYTES


def layer_block_bytes(spec: ModelSpec, layer_kind: str, block_size: int, kv_format: str = "bf16",
                      group_size: int | None = None, outlier_frac: float = 0.0, tp: int = 1,
                      key_quant: str = "per-channel", outlier_channels: int | None = None) -> int:
    """Bytes one block of ``block_size`` tokens holds in one layer of ``layer_kind``.

    Full/sliding: ``kv_heads_per_rank x head_block_bytes``; MLA: ``block_size`` latents of
    :func:`vector_bytes`; linear attention: 0. Outliers (``outlier_channels``, else
    ``outlier_frac`` of head_dim) count on quantized formats only.
    """
    if layer_kind in (FULL, SLIDING):
        outliers = outlier_count(spec.head_dim, outlier_channels, outlier_frac)
        return kv_heads_per_rank(spec, tp) * head_block_bytes(
            block_size, spec.head_dim, kv_format, group_size, key_quant, outliers)
    if layer_kind == MLA:
        latent = spec.kv_lora_rank + spec.qk_rope_head_dim
        return block_size * vector_bytes(latent, kv_format, group_size, outlier_frac)
    if layer_kind == LINEAR:
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


def layer_bytes_per_token(
    spec: ModelSpec,
    layer_kind: str,
    kv_format: str = "bf16",
    group_size: int | None = None,
    outlier_frac: float = 0.0,
    tp: int = 1,
    key_quant: str = "per-channel",
    outlier_channels: int | None = None,
    block_size: int = 16,
) -> int:
    """Bytes one token stores in one layer of ``layer_kind`` (0 for linear attention): the
    layer's :func:`layer_block_bytes` / ``block_size``, rounded up (exact for the
    full-precision formats: ``2 x kv_heads_per_rank x head_dim x element bytes``)."""
    block = layer_block_bytes(spec, layer_kind, block_size, kv_format, group_size, outlier_frac,
                              tp, key_quant, outlier_channels)
    return -(-block // block_size)


def kv_bytes_per_token(
    spec: ModelSpec,
    kv_format: str = "bf16",
    window_aware: bool = False,
    group_size: int | None = None,
    outlier_frac: float = 0.0,
    tp: int = 1,
    key_quant: str = "per-channel",
    outlier_channels: int | None = None,
    block_size: int = 16,
) -> int:
    """Bytes of KV one token adds, summed over the layers that store per-token KV.

    With ``window_aware=False`` (the JSON contract's ``kv_bytes_per_token``) every full, sliding
    and MLA layer counts. With ``window_aware=True`` sliding layers are left out: the figure is
    the growth per token once the context is past every window.
    """
    return sum(
        layer_bytes_per_token(spec, kind, kv_format, group_size, outlier_frac, tp, key_quant,
                              outlier_channels, block_size)
        for kind in spec.layer_types
        if not (window_aware and kind == SLIDING)
    )


def kv_bytes_per_block(
    spec: ModelSpec,
    block_size: int,
    kv_format: str = "bf16",
    group_size: int | None = None,
    outlier_frac: float = 0.0,
    tp: int = 1,
    key_quant: str = "per-channel",
    outlier_channels: int | None = None,
) -> int:
    """Bytes one paged-KV block of ``block_size`` token slots holds across all per-token layers:
    exactly the bytes of the engine's pool tensors per block (codes, scales, zero points and
    outliers for a quantized format; ``block_size x layers x 2 x kv_heads x head_dim x element
    bytes`` for fp32/fp16/bf16).

    Raises:
        InvalidParameterError: ``block_size <= 0``, or a bad layout option.
    """
    if block_size <= 0:
        raise InvalidParameterError(f"--block-size must be positive, got {block_size}")
    return sum(layer_block_bytes(spec, kind, block_size, kv_format, group_size, outlier_frac,
                                 tp, key_quant, outlier_channels) for kind in spec.layer_types)


def residual_bytes(spec: ModelSpec, block_size: int, compute_format: str, tp: int = 1) -> int:
    """Bytes of the full-precision residual block a quantized engine keeps per running
    sequence (its last, partial block, in the compute dtype ``compute_format``)."""
    return kv_bytes_per_block(spec, block_size, compute_format, tp=tp)


def layer_tokens(spec: ModelSpec, layer_kind: str, tokens: int, window_aware: bool) -> int:
    """Tokens a layer keeps for a sequence of ``tokens``: capped at the window when sliding."""
    if window_aware and layer_kind == SLIDING and spec.sliding_window:
        return min(tokens, spec.sliding_window)
    return tokens


def kv_bytes_per_sequence(
    spec: ModelSpec,
    tokens: int,
    kv_format: str = "bf16",
    window_aware: bool = True,
    group_size: int | None = None,
    outlier_frac: float = 0.0,
    tp: int = 1,
    block_size: int | None = None,
    key_quant: str = "per-channel",
    outlier_channels: int | None = None,
) -> int:
    """Bytes of per-token KV one sequence of ``tokens`` holds (fixed state excluded).

    Args:
        tokens: sequence length (prompt + generated), >= 0.
        window_aware: cap sliding layers at their window (hybrid allocator) or not.
        block_size: when given, each layer holds whole blocks of :func:`layer_block_bytes`, as
            a paged engine allocates; else tokens x :func:`layer_bytes_per_token` (16-token
            blocks' metadata spread per token).

    See :func:`fixed_state_bytes` for the per-sequence state of linear-attention layers and
    :func:`residual_bytes` for a quantized engine's partial block.
    """
    if tokens < 0:
        raise InvalidParameterError(f"token count must be >= 0, got {tokens}")
    layout = (kv_format, group_size, outlier_frac, tp, key_quant, outlier_channels)
    total = 0
    for kind in spec.layer_types:
        kept = layer_tokens(spec, kind, tokens, window_aware)
        if block_size:
            total += math.ceil(kept / block_size) * layer_block_bytes(spec, kind, block_size,
                                                                      *layout)
        else:
            total += kept * layer_bytes_per_token(spec, kind, *layout)
    return total


def fixed_state_bytes(
    spec: ModelSpec, state_bytes_per_element: int = FP16_BYTES, tp: int = 1
) -> int:
    """Bytes of the fixed per-sequence state of all linear-attention layers (0 if none), per
    tensor-parallel rank (the state is split by heads across ranks).

    The state (recurrent matrix + convolution tail) does not grow with the context and is kept
    in the activation dtype (bf16 by default) whatever the KV format.
    """
    layers = sum(1 for kind in spec.layer_types if kind == LINEAR)
    return math.ceil(layers * spec.linear_state_elements * state_bytes_per_element / tp)
