"""One tensor-parallel rank's share of a Llama-family model (Megatron-LM's split: Shoeybi et al.,
arXiv:1909.08053, §3).

Per layer, rank ``r`` of ``tp`` holds:

- the rows of Q for its ``heads / tp`` query heads, and the rows of K and V for the KV heads
  those queries read: ``kv_heads / tp`` heads, or, when there are fewer KV heads than ranks,
  the one KV head of its query group, replicated on ``tp / kv_heads`` ranks (the ledger's
  rule, :func:`kvledger.ledger.kv.kv_heads_per_rank`);
- the columns of the output projection for the same query heads (its output is a partial sum,
  all-reduced across ranks);
- the rows of gate and up for ``intermediate / tp`` channels and the same columns of down
  (again a partial sum, all-reduced);
- the norms and the token embedding whole, and ``ceil(vocab / tp)`` rows of the LM head
  (the last rank's padded with zero rows, so every rank's logits have one width for the
  gather; the padding is cut off on rank 0).

Weights use Hugging Face names ([out, in] projections). A GGUF's Q4 parts (``.q4_codes``
[out, in], ``.q4_scale`` / ``.q4_zero`` [out, in / 32]) are split with their dense rows, and
along columns only at whole groups of 32; otherwise they are dropped and the rank keeps the
dense weight (the Q4 kernel is a bf16 speed format, never needed for exactness). A K-quant
GGUF's blocks (:class:`~kvledger.model.kquant.GGMLMatrix`) are split by rows as they are, by
columns at whole blocks (else dequantized, :meth:`~kvledger.model.kquant.GGMLMatrix.columns`).
"""

from __future__ import annotations

import dataclasses

import torch

from kvledger.errors import InvalidParameterError
from kvledger.ledger.kv import kv_heads_per_rank
from kvledger.model.kquant import GGMLMatrix
from kvledger.model.q4 import GROUP
from kvledger.spec import MLA, ModelSpec

Q4_PARTS = (".q4_codes", ".q4_scale", ".q4_zero")
NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight",
         "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight",
         "self_attn.q_norm.weight", "self_attn.k_norm.weight")
"""A layer's norms, each held whole by every rank (q / k norms act per head)."""


def check_divisible(spec: ModelSpec, tp: int) -> None:
    """Raise unless ``spec`` splits over ``tp`` ranks.

    Raises:
        InvalidParameterError: ``tp`` does not divide the query heads (or the KV heads and
            ``tp`` do not divide one another; the message names the head counts), or the MLP
            width; or the model routes to experts or caches an MLA latent (their sharding is
            not implemented), or normalizes q / k over the whole projection (across the ranks'
            heads: not implemented).
    """
    if spec.attention.qk_norm_full_width:
        raise InvalidParameterError(
            f"--tensor-parallel-size {tp}: {spec.name} ({spec.model_type}) normalizes q and k "
            "over the whole projection, which tensor parallelism does not shard yet; run it "
            "with --tensor-parallel-size 1")
    if MLA in spec.layers.types:
        raise InvalidParameterError(
            f"--tensor-parallel-size {tp}: {spec.name} ({spec.model_type}) uses MLA "
            "(multi-head latent attention), which tensor parallelism does not shard yet; run "
            "it with --tensor-parallel-size 1")
    if spec.is_moe:
        raise InvalidParameterError(
            f"--tensor-parallel-size {tp}: {spec.name} ({spec.model_type}) routes to "
            f"{spec.experts.count} experts, and tensor parallelism does not shard experts yet; "
            "run it with --tensor-parallel-size 1")
    kv_heads_per_rank(spec, tp)
    if spec.intermediate_size % tp:
        raise InvalidParameterError(
            f"--tensor-parallel-size {tp} does not divide the model's MLP width "
            f"(intermediate_size {spec.intermediate_size})")


def vocab_shard(spec: ModelSpec, tp: int) -> int:
    """LM-head rows per rank: ``ceil(vocab / tp)``."""
    return -(-spec.vocab_size // tp)


def shard_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The architecture one rank computes: its query and KV heads, MLP width and LM-head rows."""
    check_divisible(spec, tp)
    return dataclasses.replace(
        spec, num_attention_heads=spec.num_attention_heads // tp,
        num_kv_heads=kv_heads_per_rank(spec, tp), intermediate_size=spec.intermediate_size // tp,
        vocab_size=vocab_shard(spec, tp))


def kv_head_range(spec: ModelSpec, tp: int, rank: int) -> range:
    """KV heads rank ``rank`` holds (one head shared by ``tp / kv_heads`` ranks when
    ``kv_heads < tp``: query head j reads KV head ``j // (heads / kv_heads)``)."""
    per_rank = kv_heads_per_rank(spec, tp)
    if spec.num_kv_heads >= tp:
        return range(rank * per_rank, (rank + 1) * per_rank)
    first = rank * (spec.num_attention_heads // tp) // spec.gqa_group_size
    return range(first, first + 1)


def shard_weights(weights: dict[str, torch.Tensor], spec: ModelSpec, tp: int, rank: int
                  ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors (views where possible) under the same names; the LM head is
    always present as ``lm_head.weight`` (a tied embedding stays whole as the embedding).

    Raises:
        InvalidParameterError: as :func:`check_divisible`; or a bias on the output or down
            projection (none in the Llama family), which the all-reduce would add tp times.
    """
    check_divisible(spec, tp)
    d, heads = spec.head_dim, spec.num_attention_heads // tp
    q = range(rank * heads * d, (rank + 1) * heads * d)
    kv = kv_head_range(spec, tp, rank)
    kv = range(kv.start * d, kv.stop * d)
    f = spec.intermediate_size // tp
    mlp = range(rank * f, (rank + 1) * f)
    out: dict[str, torch.Tensor] = {}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for name in NORMS:
            if p + name in weights:
                out[p + name] = weights[p + name]
        for proj, rows in (("self_attn.q_proj", q), ("self_attn.k_proj", kv),
                           ("self_attn.v_proj", kv), ("mlp.gate_proj", mlp),
                           ("mlp.up_proj", mlp)):
            _rows(weights, out, p + proj, rows)
        for proj, cols in (("self_attn.o_proj", q), ("mlp.down_proj", mlp)):
            if p + proj + ".bias" in weights:
                raise InvalidParameterError(
                    f"{p + proj} has a bias: tensor parallelism splits it row-wise only "
                    "without one")
            _columns(weights, out, p + proj, cols)
    out["model.norm.weight"] = weights["model.norm.weight"]
    embed = weights["model.embed_tokens.weight"]
    out["model.embed_tokens.weight"] = embed
    out["lm_head.weight"] = _head_rows(weights.get("lm_head.weight", embed), spec, tp, rank)
    return out


def _rows(src: dict, out: dict, stem: str, rows: range) -> None:
    out[stem + ".weight"] = src[stem + ".weight"][rows.start:rows.stop]
    if stem + ".bias" in src:
        out[stem + ".bias"] = src[stem + ".bias"][rows.start:rows.stop]
    if stem + Q4_PARTS[0] in src:
        for part in Q4_PARTS:
            out[stem + part] = src[stem + part][rows.start:rows.stop]


def _columns(src: dict, out: dict, stem: str, cols: range) -> None:
    weight = src[stem + ".weight"]
    if isinstance(weight, GGMLMatrix):
        out[stem + ".weight"] = weight.columns(cols.start, cols.stop)
        return
    out[stem + ".weight"] = weight[:, cols.start:cols.stop]
    if stem + Q4_PARTS[0] in src and cols.start % GROUP == 0 and cols.stop % GROUP == 0:
        out[stem + ".q4_codes"] = src[stem + ".q4_codes"][:, cols.start:cols.stop]
        for part in Q4_PARTS[1:]:
            out[stem + part] = src[stem + part][:, cols.start // GROUP:cols.stop // GROUP]


def _head_rows(head: torch.Tensor, spec: ModelSpec, tp: int, rank: int) -> torch.Tensor:
    rows = vocab_shard(spec, tp)
    part = head[rank * rows:(rank + 1) * rows]
    if part.shape[0] == rows:
        return part
    if isinstance(part, GGMLMatrix):  # zero bytes: blocks of scale 0, weights 0
        data = part.data.new_zeros(rows - part.shape[0], part.data.shape[1])
        return GGMLMatrix(part.type_name, torch.cat([part.data, data]), part.in_features)
    return torch.cat([part, part.new_zeros(rows - part.shape[0], head.shape[1])])
