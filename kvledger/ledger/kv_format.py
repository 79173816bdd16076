"""What a KV format is: the storage table of each named format and :class:`KVFormatSpec`, the
one value that names a format and its options (group, key mode, outliers, residual, intact
tokens, rotation).

The storage layouts (seed §4.2), as the engine stores them (``engine/kv/codecs.py``):

  fp32 / fp16 / bf16   4 / 2 / 2 bytes per element, no metadata
  fp8 (e4m3)           1 byte per element + one fp32 scale per block and KV head, for K and V
  int8 / int4 / int3 / int2
                       8 / 4 / 3 / 2 bits per element (int4: two per byte, int2: four, int3:
                       eight in three bytes) + an fp16 scale and an fp16 zero point per
                       group (asymmetric). Values: groups of ``group_size``
                       along head_dim, per token. Keys ``per-channel`` (default, KIVI): one
                       group per channel over a *key group* of G tokens (G a multiple of the
                       block size: its k = G / block_size blocks each hold D / k channels' scale
                       and zero point); or ``per-token`` like values.
  window               the most recent tokens stay in the compute dtype (KIVI's residual, R
                       tokens per running sequence); older tokens are quantized a whole key
                       group at a time (:meth:`KVFormatSpec.sealed_blocks`).
  intact               the first N tokens of a sequence (its attention sinks) are never
                       quantized: they stay in the compute dtype for the sequence's life
                       (IntactKV, arXiv:2403.01241; StreamingLLM's sinks, arXiv:2309.17453).
  outliers             ``n`` key channels per layer and KV head also kept in fp16 (2 bytes per
                       token each); the codes still cover every channel. Channel indices are
                       calibrated once per layer, so they cost no bytes per block.

What these cost is :mod:`kvledger.ledger.kv`. No torch here.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace

from kvledger.errors import InvalidParameterError

KV_FORMATS = ("fp32", "fp16", "bf16", "fp8", "int8", "int4", "int3", "int2")
INT_FORMATS = ("int8", "int4", "int3", "int2")
"""The asymmetric integer formats (codes, scale and zero point per group)."""
PACK_CHANNELS = {8: 1, 4: 2, 3: 8, 2: 4}
"""Channels of an integer format packed together (a byte; int3: three bytes), by bits: its
head_dim must be a multiple."""
KEY_QUANT_MODES = ("per-channel", "per-token")
ROTATIONS = ("none", "hadamard")
DEFAULT_GROUP_SIZE = 32
DEFAULT_KEY_GROUP_TOKENS = {"int3": 32, "int2": 32}
"""Tokens per key group of the formats whose default spans blocks (the others' default is one
block)."""
DEFAULT_RESIDUAL_TOKENS = {"int4": 128, "int3": 128, "int2": 128}
"""The full-precision window R of the formats whose default is more than their key group."""
DEFAULT_INTACT_TOKENS = {"int4": 32, "int3": 32, "int2": 32}
"""Intact tokens N of the formats that keep some by default (the others: none). These three
tables are the best settings measured on the bundled model at the serving chunk (issue 58,
BENCHMARKS.md#kv-quality); int8 is within 0.01 % of fp16 without them."""
FP16_BYTES = 2
FP32_BYTES = 4


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
        """True for the formats below 16 bits (fp8 and the integer formats)."""
        return self.bits < 16


_FORMATS = {
    "fp32": KVFormat("fp32", 32, 0),
    "fp16": KVFormat("fp16", 16, 0),
    "bf16": KVFormat("bf16", 16, 0),
    "fp8": KVFormat("fp8", 8, 0),
    "int8": KVFormat("int8", 8, 2 * FP16_BYTES),
    "int4": KVFormat("int4", 4, 2 * FP16_BYTES),
    "int3": KVFormat("int3", 3, 2 * FP16_BYTES),
    "int2": KVFormat("int2", 2, 2 * FP16_BYTES),
}


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


@dataclass(frozen=True)
class KVFormatSpec:
    """One KV format and its options; every ledger KV function takes one.

    Attributes:
        name: one of :data:`KV_FORMATS`.
        group_size: int8/int4 elements per scale group along head_dim (values, per-token
            keys); None = :func:`resolve_group_size`'s default for the model's head_dim.
        key_quant: int8/int4 keys, one of :data:`KEY_QUANT_MODES`.
        outlier_channels: key channels per layer and KV head kept in fp16; None =
            ``ceil(outlier_frac x head_dim)``.
        outlier_frac: fraction of key channels kept in fp16 when ``outlier_channels`` is None
            (``kvledger plan --kv-outlier-frac``; an MLA latent's outliers are always this
            fraction of the latent).
        residual_tokens: R, the full-precision window of a running sequence (quantized
            formats): blocks not yet sealed, at most R tokens; a multiple of the block size
            and at least the key group; None = :data:`DEFAULT_RESIDUAL_TOKENS` (128 for int4 /
            int3 / int2, rounded up to a multiple of the block size and to the key group),
            the key group for the others.
        key_group_tokens: G, tokens of one per-channel key group (int formats, per-channel
            keys): a multiple of the block size; None = :data:`DEFAULT_KEY_GROUP_TOKENS` (32
            for int3 / int2, rounded up to a multiple of the block size), one block for the
            others.
        rotation: ``none`` or ``hadamard`` (quantized formats: K and V rows rotated by an
            orthogonal matrix before quantization, ``engine/kv/rotation.py``); the bytes are
            the same either way.
        intact_tokens: N, the first tokens of every sequence kept in the compute dtype and
            never quantized (quantized formats; 0 = none), rounded up to whole key groups;
            None = :data:`DEFAULT_INTACT_TOKENS` (32 for int4 / int3 / int2, none for the
            others).

    Raises:
        InvalidParameterError: an unknown name, key mode or rotation; a rotation or intact
            tokens on a full-precision format; intact tokens below 0.
    """

    name: str = "bf16"
    group_size: int | None = None
    key_quant: str = "per-channel"
    outlier_channels: int | None = None
    outlier_frac: float = 0.0
    residual_tokens: int | None = None
    rotation: str = "none"
    key_group_tokens: int | None = None
    intact_tokens: int | None = None

    def __post_init__(self) -> None:
        kv_format(self.name)
        if self.key_quant not in KEY_QUANT_MODES:
            raise InvalidParameterError(f"--kv-key-quant must be one of "
                                        f"{', '.join(KEY_QUANT_MODES)}, got {self.key_quant!r}")
        if self.rotation not in ROTATIONS:
            raise InvalidParameterError(
                f"--kv-rotation must be one of {', '.join(ROTATIONS)}, got {self.rotation!r}")
        if self.rotation != "none" and not self.quantized:
            raise InvalidParameterError(f"--kv-rotation {self.rotation} applies to quantized KV "
                                        f"formats, not {self.name}")
        if self.intact_tokens is None and not self.quantized:  # the same text as before
            object.__setattr__(self, "intact_tokens", 0)
        if self.intact_tokens is not None and self.intact_tokens < 0:
            raise InvalidParameterError(
                f"--kv-intact-tokens must be >= 0, got {self.intact_tokens}")
        if self.intact_tokens and not self.quantized:
            raise InvalidParameterError(f"--kv-intact-tokens applies to quantized KV formats, "
                                        f"not {self.name}")

    @classmethod
    def from_options(cls, kv_cache_dtype: str, compute_format: str = "bf16",
                     group_size: int | None = None, key_quant: str = "per-channel",
                     outlier_channels: int | None = None, outlier_frac: float = 0.0,
                     residual_tokens: int | None = None, rotation: str = "none",
                     key_group_tokens: int | None = None,
                     intact_tokens: int | None = None) -> KVFormatSpec:
        """The spec of the ``--kv-*`` options: ``auto`` is ``compute_format`` (the activations'
        format, bf16 or fp32); every other option as given. The one place the engine
        (``EngineConfig.kv_format_spec``), the planner, replay and eval build a spec."""
        name = compute_format if kv_cache_dtype == "auto" else kv_cache_dtype
        return cls(name, group_size, key_quant, outlier_channels, outlier_frac, residual_tokens,
                   rotation, key_group_tokens, intact_tokens)

    @property
    def quantized(self) -> bool:
        """True for fp8, int8 and int4."""
        return kv_format(self.name).quantized

    @property
    def storage(self) -> KVFormat:
        """The storage layout of :attr:`name`."""
        return kv_format(self.name)

    def as_format(self, name: str) -> KVFormatSpec:
        """The same options under format ``name``; outliers dropped on a full-precision one
        (the planner's what-if rows)."""
        if kv_format(name).quantized:
            return replace(self, name=name)
        return replace(self, name=name, outlier_channels=None, outlier_frac=0.0, rotation="none",
                       intact_tokens=0)

    @property
    def intact_count(self) -> int:
        """N: :attr:`intact_tokens`, or the format's default when None."""
        if self.intact_tokens is None:
            return DEFAULT_INTACT_TOKENS.get(self.name, 0)
        return self.intact_tokens

    def blockwise_defaults(self, block_size: int) -> KVFormatSpec:
        """The spec with the defaults that keep every block self-contained, for the models
        whose sliding layers give blocks back one at a time: a key group of one
        block and no intact tokens where the options left them to the default (None). What
        the options set explicitly stays, for the caller to refuse."""
        group = block_size if self.key_group_tokens is None else self.key_group_tokens
        intact = 0 if self.intact_tokens is None else self.intact_tokens
        return replace(self, key_group_tokens=group, intact_tokens=intact)

    def outlier_count(self, head_dim: int) -> int:
        """Key channels kept in fp16 per layer and KV head of ``head_dim`` channels.

        Raises:
            InvalidParameterError: not in [0, head_dim).
        """
        n = self.outlier_channels
        if n is None:
            n = math.ceil(self.outlier_frac * head_dim)
        if not 0 <= n < head_dim:
            raise InvalidParameterError(
                f"--kv-outlier-channels must be in [0, head_dim {head_dim}), got {n}")
        return n

    def key_group_blocks(self, block_size: int) -> int:
        """Blocks per key group, k = G / block_size (1 but for per-channel int keys).

        Raises:
            InvalidParameterError: G not a positive multiple of ``block_size``.
        """
        if self.name not in INT_FORMATS or self.key_quant != "per-channel":
            return 1
        g = self.key_group_tokens
        if g is None:
            default = DEFAULT_KEY_GROUP_TOKENS.get(self.name, block_size)
            return -(-default // block_size)
        if g <= 0 or g % block_size:
            raise InvalidParameterError(f"--kv-key-group-tokens {g} must be a positive multiple "
                                        f"of --block-size {block_size}")
        return g // block_size

    def residual_blocks(self, block_size: int) -> int:
        """Blocks of the full-precision window R (None: the key group's blocks).

        Raises:
            InvalidParameterError: R not a positive multiple of ``block_size``, or smaller
                than the key group (a group is sealed whole, from the window).
        """
        group = self.key_group_blocks(block_size)
        r = self.residual_tokens
        if r is None:
            return max(group, -(-DEFAULT_RESIDUAL_TOKENS.get(self.name, 0) // block_size))
        if r <= 0 or r % block_size:
            raise InvalidParameterError(f"--kv-residual-tokens {r} must be a positive multiple "
                                        f"of --block-size {block_size}")
        if r // block_size < group:
            raise InvalidParameterError(f"--kv-residual-tokens {r} must be at least the key "
                                        f"group of {group * block_size} tokens")
        return r // block_size

    def intact_blocks(self, block_size: int) -> int:
        """Leading blocks never quantized: N tokens rounded up to whole key groups (the
        groups after them stay aligned on G)."""
        k = self.key_group_blocks(block_size)
        return -(-self.intact_count // (k * block_size)) * k

    def reserved_blocks(self, block_size: int) -> int:
        """Full-precision blocks the engine reserves per running sequence: the window, the
        sequence's intact blocks, and as many again for a finished sequence's intact blocks
        kept in the prefix cache (a conversation's next turn starts from them)."""
        return self.residual_blocks(block_size) + 2 * self.intact_blocks(block_size)

    def sealed_blocks(self, tokens: int, block_size: int) -> int:
        """Leading blocks of a sequence of ``tokens`` tokens that are final: whole key
        groups (k blocks), as many as leave at most R tokens in the window, i.e.
        ``k x floor((tokens - R + G) / G)`` blocks, 0 while ``tokens < R``. The window then
        holds between R - G and R - 1 tokens (with G = R = one block: every full block is
        sealed, the partial one is not). The first :meth:`intact_blocks` of them stay in the
        compute dtype; the rest are quantized. A full-precision format seals nothing."""
        if not self.quantized:
            return 0
        k, r = self.key_group_blocks(block_size), self.residual_blocks(block_size)
        groups = max(0, tokens - (r - k) * block_size) // (k * block_size)
        return groups * k

    def full_precision_blocks(self, tokens: int, block_size: int) -> int:
        """Blocks of a sequence of ``tokens`` tokens held in the compute dtype: the window
        (at most R / bs) and the intact blocks."""
        if not self.quantized:
            return 0
        sealed = self.sealed_blocks(tokens, block_size)
        return -(-tokens // block_size) - sealed + min(sealed, self.intact_blocks(block_size))

    def to_json(self) -> str:
        """Every field, keys sorted, no spaces: a stable text (cache keys, file headers)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
