"""KVLayout: the KV format an engine runs, resolved once from its options and the model.

It answers, from the ledger (``ledger/kv.py``), the bytes a block and the residual buffers
take, and builds the matching store: :class:`KVStore` for fp32/bf16/fp16,
:class:`QuantizedKVStore` for fp8/int8/int4, so the pool holds exactly the bytes the ledger
predicts. ``describe`` is the startup line's and ``/metrics``' name for the format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvledger.engine.kv.store import KV_FORMAT_OF_DTYPE, STORAGE_DTYPES, KVStore
from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import (
    kv_bytes_per_block,
    kv_bytes_per_token,
    kv_format,
    kv_heads_per_rank,
    outlier_count,
    residual_bytes,
    resolve_group_size,
)
from kvledger.spec import ModelSpec


def resolve_kv_format(kv_cache_dtype: str, compute_dtype: torch.dtype) -> str:
    """The KV format ``--kv-cache-dtype`` names: ``auto`` is bf16, or fp32 under fp32 compute.

    Raises:
        InvalidParameterError: an unknown format.
    """
    if kv_cache_dtype == "auto":
        return "fp32" if compute_dtype == torch.float32 else "bf16"
    kv_format(kv_cache_dtype)
    return kv_cache_dtype


@dataclass(frozen=True)
class KVLayout:
    """A resolved KV format.

    Attributes:
        kv_format: fp32, bf16, fp16, fp8, int8 or int4; compute_dtype: attention's dtype.
        group_size: int8/int4 group along head_dim (None for other formats).
        key_quant: per-channel or per-token (int8/int4 keys).
        outlier_channels: fp16 key channels per layer and KV head (quantized formats).
        block_size: tokens per block; residual_slots: partial blocks kept at full precision.
        tp: tensor-parallel ranks; every figure is one rank's (its ``kv_heads_per_rank``).
    """

    spec: ModelSpec
    kv_format: str
    compute_dtype: torch.dtype
    block_size: int
    group_size: int | None
    key_quant: str
    outlier_channels: int
    residual_slots: int
    tp: int = 1

    @property
    def quantized(self) -> bool:
        """True for fp8, int8 and int4."""
        return kv_format(self.kv_format).quantized

    def _kw(self) -> dict:
        return {"group_size": self.group_size, "key_quant": self.key_quant,
                "outlier_channels": self.outlier_channels, "tp": self.tp}

    @property
    def bytes_per_block(self) -> int:
        """The ledger's bytes per block: what each pool block's tensors hold."""
        return kv_bytes_per_block(self.spec, self.block_size, self.kv_format, **self._kw())

    @property
    def bytes_per_token(self) -> int:
        """The ledger's bytes per token (the block's bytes / block size, rounded up)."""
        return kv_bytes_per_token(self.spec, self.kv_format, block_size=self.block_size,
                                  **self._kw())

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the residual buffers outside the blocks (0 for full-precision formats)."""
        if not self.quantized:
            return 0
        compute = KV_FORMAT_OF_DTYPE[self.compute_dtype]
        return self.residual_slots * residual_bytes(self.spec, self.block_size, compute, self.tp)

    def describe(self) -> str:
        """E.g. ``int4 (keys per-channel, values per-token groups of 32, 4 fp16 outlier
        channels, residual block fp32)`` or ``bf16``."""
        if not self.quantized:
            return self.kv_format
        compute = KV_FORMAT_OF_DTYPE[self.compute_dtype]
        if self.kv_format == "fp8":
            parts = ["e4m3, a scale per block and KV head"]
        else:
            parts = [f"keys {self.key_quant}", f"values per-token groups of {self.group_size}"]
        if self.outlier_channels:
            parts.append(f"{self.outlier_channels} fp16 outlier key channels")
        parts.append(f"residual block {compute}")
        return f"{self.kv_format} ({', '.join(parts)})"

    def build_store(self, num_blocks: int, outlier_index: torch.Tensor | None = None,
                    rank: int = 0):
        """Rank ``rank``'s store for ``num_blocks`` blocks: its KV heads only under tensor
        parallelism (``parallel.shard.kv_head_range``). ``outlier_index`` [layers, kv_heads, n]
        long: the calibrated outlier channels of every KV head of the whole model."""
        s = self.spec
        heads = kv_heads_per_rank(s, self.tp)
        if not self.quantized:
            return KVStore(s.num_layers, num_blocks, self.block_size, heads, s.head_dim,
                           STORAGE_DTYPES[self.kv_format], self.compute_dtype)
        from kvledger.engine.kv.codecs import make_codecs
        from kvledger.engine.kv.quantized_store import QuantizedKVStore

        if outlier_index is not None and self.tp > 1:
            from kvledger.engine.parallel.shard import kv_head_range

            own = kv_head_range(s, self.tp, rank)
            outlier_index = outlier_index[:, own.start:own.stop]
        keys, values = make_codecs(self.kv_format, self.block_size, heads, s.head_dim,
                                   self.group_size or s.head_dim, self.key_quant, outlier_index)
        return QuantizedKVStore(s.num_layers, num_blocks, self.block_size, heads, s.head_dim,
                                self.kv_format, keys, values, self.compute_dtype,
                                self.residual_slots)


def resolve_layout(config, spec: ModelSpec, compute_dtype: torch.dtype) -> KVLayout:
    """The KVLayout of an EngineConfig's kv_* options on ``spec``.

    Raises:
        InvalidParameterError: a group size that does not divide head_dim, outlier channels
            on a full-precision format or not fewer than head_dim, int4 with an odd head_dim.
    """
    fmt = resolve_kv_format(config.kv_cache_dtype, compute_dtype)
    quantized = kv_format(fmt).quantized
    if config.kv_outlier_channels and not quantized:
        raise InvalidParameterError(
            f"--kv-outlier-channels applies to quantized KV formats (fp8, int8, int4), not {fmt}")
    outliers = outlier_count(spec.head_dim, config.kv_outlier_channels, 0.0)
    group = None
    if fmt in ("int8", "int4"):
        group = resolve_group_size(config.kv_group_size, spec.head_dim)
    layout = KVLayout(spec, fmt, compute_dtype, config.block_size, group, config.kv_key_quant,
                      outliers, config.max_num_seqs, config.tensor_parallel_size)
    layout.bytes_per_block  # noqa: B018 - validates the layout (int4 with odd head_dim)
    return layout
