"""KVLayout: the KV format an engine runs (a ``KVFormatSpec``), resolved once from its options
and the model.

It answers, from the ledger (``ledger/kv.py``), the bytes a block and the residual buffers
take, and builds the matching store: :class:`KVStore` for fp32/bf16/fp16,
:class:`QuantizedKVStore` for fp8/int8/int4, so the pool holds exactly the bytes the ledger
predicts. ``describe`` is the startup line's and ``/metrics``' name for the format.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kvledger.engine.kv.latent_store import LatentStore
from kvledger.engine.kv.store import KV_FORMAT_OF_DTYPE, STORAGE_DTYPES, KVStore
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import (
    kv_bytes_per_page,
    kv_bytes_per_token,
    kv_heads_per_rank,
    residual_bytes,
)
from kvledger.ledger.kv_format import INT_FORMATS, KVFormatSpec, resolve_group_size
from kvledger.ledger.kv_groups import KVGroup, kv_groups, layer_places
from kvledger.spec import MLA, ModelSpec

log = logging.getLogger("kvledger.engine")


@dataclass(frozen=True)
class KVLayout:
    """A resolved KV format.

    Attributes:
        fmt: the format with its options resolved on the model: ``group_size`` set for
            int8/int4 (None for the others), ``outlier_channels`` a count (quantized formats).
        compute_dtype: attention's dtype.
        block_size: tokens per block; residual_slots: running sequences whose window of
            ``fmt.residual_blocks`` recent blocks is kept at full precision (a quantized
            format).
        tp: tensor-parallel ranks; every figure is one rank's (its ``kv_heads_per_rank``).
    """

    spec: ModelSpec
    fmt: KVFormatSpec
    compute_dtype: torch.dtype
    block_size: int
    residual_slots: int
    tp: int = 1

    @property
    def kv_format(self) -> str:
        """The format's name: fp32, bf16, fp16, fp8, int8 or int4."""
        return self.fmt.name

    @property
    def quantized(self) -> bool:
        """True for fp8, int8 and int4."""
        return self.fmt.quantized

    @property
    def intact_blocks(self) -> int:
        """A sequence's first blocks kept at full precision (``KVFormatSpec.intact_blocks``;
        0 for a full-precision format)."""
        return self.fmt.intact_blocks(self.block_size) if self.quantized else 0

    def sealed_blocks(self, tokens: int) -> int:
        """Leading blocks of a sequence of ``tokens`` that are final: a quantized format's
        sealed ones (``KVFormatSpec.sealed_blocks``), else the full ones."""
        if self.quantized:
            return self.fmt.sealed_blocks(tokens, self.block_size)
        return tokens // self.block_size

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The model's layer groups, one block table each (``ledger/kv_groups.py``)."""
        return kv_groups(self.spec)

    @property
    def bytes_per_block(self) -> int:
        """The ledger's bytes per block (a page: one group's block, ``kv_bytes_per_page``):
        what each pool block's tensors hold."""
        return kv_bytes_per_page(self.spec, self.fmt, self.tp, self.block_size)

    @property
    def bytes_per_token(self) -> int:
        """The ledger's bytes per token (the block's bytes / block size, rounded up)."""
        return kv_bytes_per_token(self.spec, self.fmt, self.tp, self.block_size)

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the residual buffers (the windows) outside the blocks (0 for
        full-precision formats)."""
        compute = KV_FORMAT_OF_DTYPE[self.compute_dtype]
        return self.residual_slots * residual_bytes(self.spec, self.fmt, self.tp,
                                                    self.block_size, compute)

    def describe(self) -> str:
        """E.g. ``int4 (keys per-channel, values per-token groups of 32, 4 fp16 outlier
        channels, window of 16 tokens fp32)`` or ``bf16``."""
        f = self.fmt
        if not f.quantized:
            return f.name
        compute = KV_FORMAT_OF_DTYPE[self.compute_dtype]
        if f.name == "fp8":
            parts = ["e4m3, a scale per block and KV head"]
        else:
            keys = f"keys {f.key_quant}"
            if f.key_quant == "per-channel":
                keys += f" over {f.key_group_blocks(self.block_size) * self.block_size} tokens"
            parts = [keys, f"values per-token groups of {f.group_size}"]
        if f.outlier_channels:
            parts.append(f"{f.outlier_channels} fp16 outlier key channels")
        if f.rotation != "none":
            parts.append(f"{f.rotation}-rotated")
        if f.intact_tokens:
            parts.append(f"first {f.intact_blocks(self.block_size) * self.block_size} tokens "
                         f"intact")
        parts.append(f"window of {f.residual_blocks(self.block_size) * self.block_size} "
                     f"tokens {compute}")
        return f"{f.name} ({', '.join(parts)})"

    def build_store(self, num_blocks: int, outlier_index: torch.Tensor | None = None,
                    rank: int = 0, kernels=None, device: torch.device | None = None):
        """Rank ``rank``'s store for ``num_blocks`` blocks: its KV heads only under tensor
        parallelism (``parallel.shard.kv_head_range``). ``outlier_index`` [layers, kv_heads, n]
        long: the calibrated outlier channels of every KV head of the whole model; ``kernels``:
        the device's (``kvledger.device.Kernels``), whose KV encoder a quantized store uses;
        ``device``: the torch device the store's tensors live on (None: the CPU)."""
        s, f = self.spec, self.fmt
        heads = kv_heads_per_rank(s, self.tp)
        places = layer_places(self.groups, s.num_layers)
        if MLA in s.layers.types:
            return LatentStore(s.num_layers, num_blocks, self.block_size,
                               s.latent.kv_lora_rank + s.latent.qk_rope_head_dim,
                               STORAGE_DTYPES[f.name], self.compute_dtype)
        if not f.quantized:
            return KVStore(s.num_layers, num_blocks, self.block_size, heads, s.head_dim,
                           STORAGE_DTYPES[f.name], self.compute_dtype, places, device)
        from kvledger.engine.kv.codecs import make_codecs
        from kvledger.engine.kv.quantized_store import QuantizedKVStore
        from kvledger.engine.kv.rotation import rotation_matrix

        if outlier_index is not None and self.tp > 1:
            from kvledger.engine.parallel.shard import kv_head_range

            own = kv_head_range(s, self.tp, rank)
            outlier_index = outlier_index[:, own.start:own.stop]
        keys, values = make_codecs(f.name, self.block_size, heads, s.head_dim,
                                   f.group_size or s.head_dim, f.key_quant, outlier_index,
                                   f.key_group_blocks(self.block_size))
        slots = self.residual_slots * len(self.groups) * f.reserved_blocks(self.block_size)
        return QuantizedKVStore(s.num_layers, num_blocks, self.block_size, heads, s.head_dim,
                                f.name, keys, values, self.compute_dtype, slots, kernels,
                                places=places,
                                rotation=rotation_matrix(f.rotation, s.head_dim), fmt=f,
                                device=device)


def resolve_format(fmt: KVFormatSpec, head_dim: int) -> KVFormatSpec:
    """``fmt`` with its group and outliers resolved on ``head_dim`` (what the engine and
    ``kvledger calibrate`` run).

    Raises:
        InvalidParameterError: a group size that does not divide head_dim, outlier channels
            on a full-precision format or not fewer than head_dim.
    """
    if fmt.outlier_channels and not fmt.quantized:
        raise InvalidParameterError(f"--kv-outlier-channels applies to quantized KV formats "
                                    f"(fp8, int8, int4), not {fmt.name}")
    group = None
    if fmt.name in INT_FORMATS:
        group = resolve_group_size(fmt.group_size, head_dim)
    return replace(fmt, group_size=group, outlier_channels=fmt.outlier_count(head_dim))


def _blockwise_if_sliding(fmt: KVFormatSpec, config, spec: ModelSpec) -> KVFormatSpec:
    """``fmt`` with the defaults that keep each block self-contained
    (``KVFormatSpec.blockwise_defaults``: keys over one block, no intact tokens) on a model
    with sliding layers, which give blocks back one at a time, logging what that changed;
    the options set explicitly are left for :func:`resolve_layout` to refuse."""
    bs = config.block_size
    blockwise = fmt.blockwise_defaults(bs)
    if len(kv_groups(spec)) == 1 or blockwise == fmt:
        return fmt
    dropped = [f"keys over {fmt.key_group_blocks(bs) * bs} tokens -> {bs}"
               if blockwise.key_group_blocks(bs) != fmt.key_group_blocks(bs) else "",
               f"{fmt.intact_count} intact tokens -> 0" if fmt.intact_blocks(bs) else ""]
    if any(dropped):
        log.info("%s defaults with sliding layers, which give blocks back one at a time: %s",
                 fmt.name, ", ".join(d for d in dropped if d))
    return blockwise


def resolve_layout(config, spec: ModelSpec, compute_dtype: torch.dtype) -> KVLayout:
    """The KVLayout of an EngineConfig's kv_* options on ``spec`` (``auto``: the KV format of
    ``compute_dtype``).

    Raises:
        InvalidParameterError: see :func:`resolve_format`; int4 with an odd head_dim; a
            rotation of a head size without a power-of-two divisor >= 8; a key group or
            window that is not a multiple of the block size, a window below the key group,
            a key group over several blocks or intact tokens on a model with sliding layers;
            a quantized format
            or a rotation on an MLA model.
    """
    fmt = config.kv_format_spec(KV_FORMAT_OF_DTYPE[compute_dtype])
    if MLA in spec.layers.types and (fmt.quantized or fmt.rotation != "none"):
        what = f"--kv-rotation {fmt.rotation}" if fmt.rotation != "none" else \
            f"--kv-cache-dtype {fmt.name}"
        raise InvalidParameterError(
            f"{what} is not supported on MLA (multi-head latent attention) models: the engine "
            "caches their latent in fp32, bf16 or fp16 only (`kvledger plan` still sizes it)")
    fmt = resolve_format(fmt, spec.head_dim)
    bs = config.block_size
    if fmt.quantized:
        fmt = _blockwise_if_sliding(fmt, config, spec)
        k = fmt.key_group_blocks(bs)
        fmt = replace(fmt, key_group_tokens=k * bs if fmt.name in INT_FORMATS else None,
                      residual_tokens=fmt.residual_blocks(bs) * bs, intact_tokens=fmt.intact_count)
        if k > 1 and len(kv_groups(spec)) > 1:
            raise InvalidParameterError(
                f"a key group of {k * bs} tokens spans blocks, which a sliding layer gives back "
                f"one by one: use --kv-key-group-tokens {bs} on this model")
        if fmt.intact_blocks(bs) and len(kv_groups(spec)) > 1:
            raise InvalidParameterError(
                "--kv-intact-tokens is for models whose layers share one block table; this "
                "model has sliding layers, which give its first blocks back")
    layout = KVLayout(spec, fmt, compute_dtype, bs, config.max_num_seqs,
                      config.tensor_parallel_size)
    layout.bytes_per_block  # noqa: B018 - validates the layout (int4 with odd head_dim)
    if fmt.rotation != "none":
        from kvledger.engine.kv.rotation import rotation_matrix

        rotation_matrix(fmt.rotation, spec.head_dim)  # refuses a head size it cannot rotate
    return layout
