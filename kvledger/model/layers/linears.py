"""A layer's Linears from a checkpoint's tensors: one projection, or several fused by rows,
held in the weight format the device chose for their shape class
(:mod:`kvledger.model.linear`), GGUF blocks kept as they are in a ``kquant`` format; which
shape classes a checkpoint stores as Q4 or as GGUF blocks (what the device may choose from);
the bytes a Linear holds.

Tensors are removed from the weights dict as they are used and their pages released
(``release``, see :class:`kvledger.model.weights.loader.MappedWeights`), so at most one layer
exists twice (source and fused) at any time.
"""

from __future__ import annotations

import torch

from kvledger.model.kquant import GGMLMatrix, KQuantLinear
from kvledger.model.linear import KQUANT_FORMATS, Q4_FORMATS, Linear, int4_shape_ok


def q4_classes(weights: dict[str, torch.Tensor]) -> set[str]:
    """Shape classes whose weights the checkpoint stores as Q4 (layer 0 speaks for all)."""
    has = {p for p in ("q", "k", "v", "o") if f"model.layers.0.self_attn.{p}_proj.q4_codes"
           in weights}
    has |= {p for p in ("gate", "up", "down") if f"model.layers.0.mlp.{p}_proj.q4_codes"
            in weights}
    classes = {"qkv"} if {"q", "k", "v"} <= has else set()
    classes |= {"o"} if "o" in has else set()
    classes |= {"gate_up"} if {"gate", "up"} <= has else set()
    classes |= {"down"} if "down" in has else set()
    return classes


def kquant_classes(weights: dict) -> set[str]:
    """Shape classes whose weights the checkpoint holds as GGUF blocks (layer 0 speaks for
    all; the LM head is the embedding when tied)."""
    stems = {"qkv": [f"self_attn.{p}_proj" for p in "qkv"], "o": ["self_attn.o_proj"],
             "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
    classes = {cls for cls, names in stems.items() if all(
        isinstance(weights.get(f"model.layers.0.{n}.weight"), GGMLMatrix) for n in names)}
    head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
    return classes | ({"lm_head"} if isinstance(head, GGMLMatrix) else set())


def held(t, dtype: torch.dtype):
    """A weight as the model holds it: GGUF blocks as they are, fp32 vectors of a GGUF's blocks
    file (its norms) as they are; other floating tensors in ``dtype``."""
    if isinstance(t, GGMLMatrix) or not t.is_floating_point() or (
            t.dim() == 1 and t.dtype == torch.float32 and dtype == torch.bfloat16):
        return t
    return t.to(dtype)


def held_bytes(linear: Linear) -> int:
    """Bytes of a Linear's weight (and scales) and its bias."""
    return linear.nbytes + (0 if linear.bias is None else linear.bias.nbytes)


def one_linear(weight, fmt: str, release, dtype: torch.dtype, kernels) -> Linear:
    """A Linear of one matrix: GGUF blocks held as they are in a ``kquant`` format (else
    dequantized to ``dtype`` for ``fmt``), a dense weight in ``fmt`` (``kquant``: dense);
    ``kernels``: the device's."""
    if isinstance(weight, GGMLMatrix):
        if fmt in KQUANT_FORMATS:
            return KQuantLinear([weight], None, fmt, kernels)
        weight = weight.dequantize(dtype, kernels)
    return Linear(weight, fmt=fmt, release=release, kernels=kernels)


def fused_linear(w: dict[str, torch.Tensor], stems: list[str], fmt: str, release,
                 dtype: torch.dtype, kernels) -> Linear:
    """One Linear over the row-concatenation of several projections (or of their 4-bit forms,
    or of their GGUF blocks: held as they are in a ``kquant`` format, else dequantized to
    ``dtype``), with their biases concatenated when they have them (``{stem}.bias``);
    ``kernels``: the device's.

    Only the source the format needs is read (the dense rows, or the Q4 codes for ``int4`` /
    ``w4a8``), so a memory-mapped weight cache never pages in the other one.
    """
    parts = (".q4_codes", ".q4_scale", ".q4_zero")
    biases = [w.pop(s + ".bias", None) for s in stems]
    bias = torch.cat(biases) if biases[0] is not None else None
    dense = [w.pop(s + ".weight") for s in stems]
    if any(isinstance(t, GGMLMatrix) for t in dense):
        if fmt in KQUANT_FORMATS and all(isinstance(t, GGMLMatrix) for t in dense):
            return KQuantLinear(dense, bias, fmt, kernels)
        dense = [t.dequantize(dtype, kernels) if isinstance(t, GGMLMatrix) else t
                 for t in dense]
    out_f, in_f = sum(t.shape[0] for t in dense), dense[0].shape[1]
    has_q4 = all(s + ".q4_codes" in w for s in stems)
    q4 = [[w.pop(s + part) for s in stems] for part in parts] if has_q4 else None
    if fmt in Q4_FORMATS and q4 is not None and dense[0].dtype == torch.bfloat16 \
            and (fmt == "w4a8" or int4_shape_ok(out_f, in_f)):
        linear = Linear.from_q4(tuple(torch.cat(p) for p in q4), (out_f, in_f), bias, fmt,
                                kernels)
    else:
        linear = Linear(torch.cat(dense).contiguous(), bias, None, fmt, kernels=kernels)
    for source in dense + [t for part in q4 or [] for t in part]:
        release(source)
    return linear
