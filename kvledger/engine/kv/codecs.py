"""KV codecs: how a quantized format stores whole blocks of K or V.

A codec turns full blocks ``x`` [n, block_size, kv_heads, head_dim] (float) into named tensors
(codes, scales, zero points, outliers), each ``[n, *shape]`` for the per-block ``shape`` that
:meth:`BlockCodec.fields` declares, and back. The store keeps one tensor per field, indexed by
physical block id, so a block's scales live with its codes and are rewritten with them.

Layouts (the ledger's ``kv.head_block_bytes`` prices exactly these fields):

- :class:`IntCodec` (int8, int4, int3, int2): asymmetric, ``x ~ zero + code x scale`` with codes in
  ``[0, 2^bits - 1]``, scale = (max - min) / (2^bits - 1) and zero = min, both fp16. Groups run
  ``per-channel`` (one scale per channel over the block's tokens: KIVI's key quantization,
  arXiv 2402.02750 §3, since key outliers sit in fixed channels) or ``per-token`` (groups of
  ``group_size`` elements along head_dim: KIVI's value quantization). Packed along head_dim,
  channel 0 in the lowest bits: int4 two codes per byte, int2 four, int3 eight codes in three
  bytes (one 24-bit little-endian word, channel 8i + j at bits 3j).
- :class:`Fp8Codec` (fp8 e4m3): one fp32 scale per block and KV head, amax / 448; values are
  clamped to +-448 before the cast, so a large channel saturates instead of becoming NaN (the
  e4m3fn type has no inf).
- :class:`GroupedKeys`: per-channel keys over a *key group* of k blocks (KIVI's G = k x
  block_size tokens): the k blocks of a group are encoded together, one scale and zero point
  per channel over all G tokens, and block j of the group stores channels ``[j D/k, (j+1) D/k)``
  of them (its ``group_fields``), so the group's metadata is stored once. Decoding a block needs
  its group's k slices: the store gathers them (``[n, k, *slice]``) by the group's block ids.
- :class:`OutlierKeys`: wraps a codec; the calibrated channels (per layer and KV head) are
  stored in fp16 beside it and zeroed before the inner codec sees the block, so they do not
  stretch its scales. The inner codes still cover every channel (a zeroed channel costs its
  codes but no range).
"""

from __future__ import annotations

import torch

from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv_format import INT_FORMATS, PACK_CHANNELS

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# smallest scale kept: the fp16 normal minimum (a smaller range is stored at this step)
MIN_SCALE = 2.0 ** -14

Fields = dict[str, tuple[tuple[int, ...], torch.dtype]]


class BlockCodec:
    """Interface: full blocks [n, block_size, kv_heads, head_dim] <-> named tensors.

    Args:
        block_size, kv_heads, head_dim: block shape.
    """

    name = "abstract"
    group_blocks = 1
    """Blocks encoded together (a key group); ``group_fields`` hold one slice of the group's
    tensor per block, and decode takes them gathered as [n, group_blocks, *slice]."""
    group_fields: tuple[str, ...] = ()

    def __init__(self, block_size: int, kv_heads: int, head_dim: int) -> None:
        self.block_size, self.kv_heads, self.head_dim = block_size, kv_heads, head_dim

    def fields(self) -> Fields:
        """Per-block shape and dtype of each stored tensor."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensors ``[n, *shape]`` per field for float blocks ``x`` [n, bs, kv_heads, D]."""
        raise NotImplementedError

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Blocks [n, bs, kv_heads, D] in ``dtype`` from tensors ``[n, *shape]`` per field."""
        raise NotImplementedError


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., D] in [0, 2^bits) -> packed bytes [..., D x bits / 8]."""
    if bits == 8:
        return codes
    per = PACK_CHANNELS[bits]
    units = codes.reshape(*codes.shape[:-1], -1, per).int()
    word = (units << (bits * torch.arange(per, dtype=torch.int32, device=codes.device))).sum(-1)
    if bits == 3:
        word = torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=-1)
    return word.to(torch.uint8).reshape(*codes.shape[:-1], -1)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: bytes [..., D x bits / 8] -> codes [..., D] (uint8)."""
    if bits == 8:
        return packed
    per = PACK_CHANNELS[bits]
    word = packed.int()
    if bits == 3:
        word = word.reshape(*packed.shape[:-1], -1, 3)
        word = word[..., 0] | (word[..., 1] << 8) | (word[..., 2] << 16)
    shifts = bits * torch.arange(per, dtype=torch.int32, device=packed.device)
    codes = (word[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(*packed.shape[:-1], -1)


class IntCodec(BlockCodec):
    """Asymmetric int8 / int4 / int3 / int2 with fp16 scale and zero point per group.

    Levels span a group's range [lo, hi]: ``scale = (hi - lo) / (2^b - 1)``, ``zero = lo``
    (the extremes exact); *centred*, ``scale = (hi - lo) / 2^b`` and ``zero = lo + scale / 2``
    (each level at the centre of one of 2^b equal bins: the squared error of near-Gaussian data
    is about half at 2 bits). Decoding is ``code x scale + zero`` either way.

    Args:
        bits: 8, 4, 3 or 2.
        axis: ``per-channel`` (groups = a channel over the block's tokens) or ``per-token``
            (groups of ``group_size`` along head_dim).
        group_size: elements per group for ``per-token``; must divide head_dim.
        centred: levels at the bins' centres.

    Raises:
        InvalidParameterError: group size that does not divide head_dim; a head_dim that is
            not a multiple of the packing unit (:data:`PACK_CHANNELS`).
    """

    def __init__(self, block_size, kv_heads, head_dim, bits: int, axis: str,
                 group_size: int, centred: bool = False) -> None:
        super().__init__(block_size, kv_heads, head_dim)
        if axis == "per-token" and head_dim % group_size:
            raise InvalidParameterError(
                f"--kv-group-size {group_size} does not divide head_dim {head_dim}")
        if head_dim % PACK_CHANNELS[bits]:
            raise InvalidParameterError(f"int{bits} KV packs {PACK_CHANNELS[bits]} channels "
                                        f"together: head_dim {head_dim} is not a multiple")
        self.bits, self.axis, self.group, self.centred = bits, axis, group_size, centred
        self.qmax = (1 << bits) - 1
        self.name = f"int{bits}/{axis}" + ("/centred" if centred else "")

    def _meta_shape(self) -> tuple[int, ...]:
        bs, h, d = self.block_size, self.kv_heads, self.head_dim
        return (h, d) if self.axis == "per-channel" else (bs, h, d // self.group)

    def fields(self) -> Fields:
        bs, h, d = self.block_size, self.kv_heads, self.head_dim
        meta = self._meta_shape()
        return {"codes": ((bs, h, d * self.bits // 8), torch.uint8),
                "scale": (meta, torch.float16), "zero": (meta, torch.float16)}

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, bs, H, D] -> groups on the last axis."""
        if self.axis == "per-channel":
            return x.permute(0, 2, 3, 1)  # [n, H, D, bs]
        n, bs, h, d = x.shape
        return x.reshape(n, bs, h, d // self.group, self.group)

    def _ungrouped(self, g: torch.Tensor) -> torch.Tensor:
        if self.axis == "per-channel":
            return g.permute(0, 3, 1, 2)
        n, bs, h = g.shape[:3]
        return g.reshape(n, bs, h, self.head_dim)

    def encode(self, x):
        g = self._grouped(x.float())
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / (self.qmax + self.centred)).clamp_min(MIN_SCALE).half()
        zero = (lo + scale.float() / 2).half() if self.centred else lo.half()
        codes = ((g - zero.float()[..., None]) / scale.float()[..., None]).round_()
        codes = pack(self._ungrouped(codes.clamp_(0, self.qmax)).to(torch.uint8), self.bits)
        return {"codes": codes.contiguous(), "scale": scale.contiguous(),
                "zero": zero.contiguous()}

    def decode(self, parts, dtype):
        g = self._grouped(unpack(parts["codes"], self.bits).float())
        x = g * parts["scale"].float()[..., None] + parts["zero"].float()[..., None]
        return self._ungrouped(x).to(dtype)


class GroupedKeys(BlockCodec):
    """Per-channel int keys over groups of ``group_blocks`` blocks (:class:`IntCodec` on the
    group's ``group_blocks x block_size`` tokens), the scales split over the group's blocks.

    ``encode`` takes the blocks of whole groups, each group's blocks consecutive and in order
    ([n x k, bs, H, D]); ``decode`` takes per block its codes and its group's gathered
    ``scale`` / ``zero`` slices [n, k, H, D / k].

    Raises:
        InvalidParameterError: head_dim not a multiple of ``group_blocks``, or what
            :class:`IntCodec` raises.
    """

    group_fields = ("scale", "zero")

    def __init__(self, block_size, kv_heads, head_dim, bits: int, group_blocks: int) -> None:
        super().__init__(block_size, kv_heads, head_dim)
        if head_dim % group_blocks:
            raise InvalidParameterError(f"a key group of {group_blocks} blocks needs head_dim "
                                        f"{head_dim} to be a multiple of {group_blocks}")
        self.group_blocks, self.bits = group_blocks, bits
        self.whole = IntCodec(block_size * group_blocks, kv_heads, head_dim, bits,
                              "per-channel", head_dim)
        self.block = IntCodec(block_size, kv_heads, head_dim, bits, "per-channel", head_dim)
        self.name = f"int{bits}/per-channel over {group_blocks} blocks"

    def fields(self) -> Fields:
        h, d, k = self.kv_heads, self.head_dim, self.group_blocks
        return {"codes": ((self.block_size, h, d * self.bits // 8), torch.uint8),
                "scale": ((h, d // k), torch.float16), "zero": ((h, d // k), torch.float16)}

    def encode(self, x):
        n, bs, h, d = x.shape
        k = self.group_blocks
        parts = self.whole.encode(x.reshape(n // k, k * bs, h, d))
        out = {"codes": parts["codes"].reshape(n, bs, h, -1)}
        for name in self.group_fields:  # [g, H, D] -> block j of a group: channels of slice j
            meta = parts[name].reshape(n // k, h, k, d // k).transpose(1, 2)
            out[name] = meta.reshape(n, h, d // k).contiguous()
        return out

    def decode(self, parts, dtype):
        n, h, d = parts["codes"].shape[0], self.kv_heads, self.head_dim
        whole = {name: parts[name].transpose(1, 2).reshape(n, h, d)
                 for name in self.group_fields}
        return self.block.decode({"codes": parts["codes"], **whole}, dtype)


class Fp8Codec(BlockCodec):
    """float8 e4m3 with one fp32 scale per block and KV head; values clamped before the cast.

    Raises:
        InvalidParameterError: the torch build has no ``float8_e4m3fn``.
    """

    name = "fp8-e4m3"

    def __init__(self, block_size, kv_heads, head_dim) -> None:
        super().__init__(block_size, kv_heads, head_dim)
        self.fp8 = getattr(torch, "float8_e4m3fn", None)
        if self.fp8 is None:
            raise InvalidParameterError(
                f"--kv-cache-dtype fp8 needs torch.float8_e4m3fn; torch {torch.__version__} "
                "lacks it (use int8)")

    def fields(self) -> Fields:
        bs, h, d = self.block_size, self.kv_heads, self.head_dim
        # stored as the fp8 bytes (torch's CPU index_copy_ has no float8 kernel)
        return {"codes": ((bs, h, d), torch.uint8), "scale": ((h,), torch.float32)}

    def encode(self, x):
        x = x.float()
        scale = (x.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)  # [n, H]
        scaled = (x / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        return {"codes": scaled.to(self.fp8).view(torch.uint8), "scale": scale}

    def decode(self, parts, dtype):
        codes = parts["codes"].view(self.fp8).float()
        return (codes * parts["scale"][:, None, :, None]).to(dtype)


class OutlierKeys(BlockCodec):
    """``inner`` for all channels but ``channels`` [kv_heads, n] (long), kept in fp16."""

    def __init__(self, inner: BlockCodec, channels: torch.Tensor) -> None:
        super().__init__(inner.block_size, inner.kv_heads, inner.head_dim)
        self.inner, self.channels = inner, channels.long()
        self.group_blocks, self.group_fields = inner.group_blocks, inner.group_fields
        self.name = f"{inner.name}+{channels.shape[1]} fp16 outliers"

    def fields(self) -> Fields:
        bs, h, n = self.block_size, self.kv_heads, self.channels.shape[1]
        return {**self.inner.fields(), "outliers": ((bs, h, n), torch.float16)}

    def _index(self, x: torch.Tensor) -> torch.Tensor:
        return self.channels.to(x.device)[None, None].expand(*x.shape[:2], -1, -1)

    def encode(self, x):
        idx = self._index(x)
        outliers = x.gather(-1, idx).half()
        parts = self.inner.encode(x.scatter(-1, idx, 0.0))
        return {**parts, "outliers": outliers}

    def decode(self, parts, dtype):
        x = self.inner.decode(parts, dtype)
        return x.scatter_(-1, self._index(x), parts["outliers"].to(dtype))


def make_codecs(kv_format: str, block_size: int, kv_heads: int, head_dim: int,
                group_size: int, key_quant: str, outlier_channels: torch.Tensor | None = None,
                key_group_blocks: int = 1) -> tuple[list[BlockCodec] | BlockCodec, BlockCodec]:
    """(key codec, value codec) of a quantized format; per-channel int keys over key groups
    of ``key_group_blocks`` blocks (:class:`GroupedKeys` when more than one).

    The key codec is one per layer (a list) when ``outlier_channels`` [layers, kv_heads, n]
    is given (each layer has its own channels), else one shared codec.

    Raises:
        InvalidParameterError: not a quantized format, or what the codecs raise.
    """
    def one(axis: str, centred: bool = False) -> BlockCodec:
        if kv_format == "fp8":
            return Fp8Codec(block_size, kv_heads, head_dim)
        if kv_format in INT_FORMATS:
            if axis == "per-channel" and key_group_blocks > 1:
                return GroupedKeys(block_size, kv_heads, head_dim, int(kv_format[3:]),
                                   key_group_blocks)
            return IntCodec(block_size, kv_heads, head_dim, int(kv_format[3:]), axis, group_size,
                            centred)
        raise InvalidParameterError(f"{kv_format} is not a quantized KV format")

    # int2 values: centred levels (measured: docs/kv-formats.md; keys keep their extremes)
    keys, values = one(key_quant), one("per-token", centred=kv_format == "int2")
    if outlier_channels is not None and outlier_channels.shape[-1] > 0:
        return [OutlierKeys(keys, ch) for ch in outlier_channels], values
    return keys, values
