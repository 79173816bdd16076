"""A block codec as the numbers a device kernel takes: the device's KV encoder and its
paged-attention reader get plain ints, floats and tensors, never the codec objects
(:mod:`.codecs`), so the device sits below the engine.

Invariant: a codec without numbers (None) is one no kernel encodes or reads; the caller then
takes the codec's own PyTorch code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvledger.engine.kv.codecs import MIN_SCALE, Fp8Codec, GroupedKeys, IntCodec, OutlierKeys


@dataclass(frozen=True)
class CodecNumbers:
    """One codec's numbers.

    Attributes:
        kind: ``"int"`` (``bits``-bit codes with a scale and zero point) or ``"fp8"`` (e4m3
            codes, a scale per block and head).
        bits: bits per code.
        group: elements per scale group along head_dim; 0: per channel over the tokens.
        centred: int zero points centred (``IntCodec.centred``).
        group_blocks: blocks per key group (1: each block alone).
        channels: [kv_heads, n] long, the outlier channels kept in fp16 (None: none).
        grouped: keys whose scales span ``group_blocks`` blocks (:class:`GroupedKeys`).
    """

    kind: str
    bits: int
    group: int
    centred: bool
    group_blocks: int
    channels: torch.Tensor | None = None
    grouped: bool = False

    min_scale = MIN_SCALE
    """The least scale every int codec rounds up to."""


def codec_numbers(codec) -> CodecNumbers | None:
    """The numbers of ``codec`` (outlier channels unwrapped), or None for a codec no kernel
    takes."""
    channels = None
    if isinstance(codec, OutlierKeys):
        channels, codec = codec.channels.contiguous(), codec.inner
    if isinstance(codec, Fp8Codec):
        return CodecNumbers("fp8", 8, 0, False, codec.group_blocks, channels)
    if isinstance(codec, IntCodec):
        group = 0 if codec.axis == "per-channel" else codec.group
        return CodecNumbers("int", codec.bits, group, codec.centred, codec.group_blocks,
                            channels)
    if isinstance(codec, GroupedKeys):
        return CodecNumbers("int", codec.bits, 0, False, codec.group_blocks, channels,
                            grouped=True)
    return None
