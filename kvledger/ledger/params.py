"""Parameter counts (total and active) and weight bytes.

Counted per component from the ModelSpec, the way the transformers modules hold them:

  embeddings    ``vocab x hidden``, once when ``tie_word_embeddings``; an untied ``lm_head``
                adds another ``vocab x hidden``; GPT-2 adds its learned position table
  attention     q, k, v, o projections (+ biases, q/k norms, sinks, output gate); MLA: the
                low-rank q (``q_a``, ``q_b``), ``kv_a`` (latent + rope key), ``kv_b``, o
                (DeepSeek-V2, arXiv:2405.04434 §2.1); Gated DeltaNet: ``in_proj_qkvz``,
                ``in_proj_ba``, the causal conv, ``A_log``, ``dt_bias``, the gated norm and
                ``out_proj`` (Qwen3-Next)
  MLP           gated (SwiGLU/GeGLU): ``3 x hidden x inter``; plain (GPT-2, NeoX): ``2 x``
  MoE           routed experts, shared experts, router (+ bias), shared-expert gate
  norms         ``norms_per_layer`` per layer plus the final norm

Active parameters (seed §3.3; Mixtral, arXiv:2401.04088 §2): everything except the routed
experts, plus ``num_experts_per_tok`` of them per MoE layer. A GGUF file's total is the element
count of its tensors. Multi-token-prediction modules (DeepSeek-V3 ``num_nextn_predict_layers``)
are not part of the served model and are not counted.

Weight bytes per dtype: fp32 4, bf16/fp16 2, fp8 1 (one per-tensor scale), int8 1 byte + an
fp16 scale per group, int4 half a byte + an fp16 scale and an fp16 zero point per group
(GPTQ/AWQ-style, default group 128), applied uniformly to every parameter (an approximation:
real checkpoints keep norms and sometimes embeddings in 16 bits). For a GGUF, the file's real
tensor bytes. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvledger.errors import InvalidParameterError
from kvledger.spec import CONV, FULL, LINEAR, MAMBA, MLA, SLIDING, ModelSpec

WEIGHT_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8", "int4")
_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int8": 8, "int4": 4}
_GROUP_META_BYTES = {"int8": 2, "int4": 4}
DEFAULT_WEIGHT_GROUP = 128


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts (elements).

    Attributes:
        total: every parameter of the served model.
        active: parameters touched per token (MoE: top-k routed experts only).
        embedding: the input embedding table (+ learned positions).
        lm_head: the untied output head (0 when tied).
    """

    total: int
    active: int
    embedding: int
    lm_head: int


def _linear(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _mlp(spec: ModelSpec, inter: int) -> int:
    h, b = spec.hidden_size, spec.mlp.bias
    if spec.mlp.gated:
        return 2 * _linear(h, inter, b) + _linear(inter, h, b)
    return _linear(h, inter, b) + _linear(inter, h, b)


def attention_params(spec: ModelSpec, layer_kind: str) -> int:
    """Parameters of one layer's token mixer (attention or linear attention), in elements."""
    h, heads, hd = spec.hidden_size, spec.num_attention_heads, spec.head_dim
    if layer_kind == MLA:
        mla = spec.latent
        q_dim = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        if mla.q_lora_rank:
            q = h * mla.q_lora_rank + mla.q_lora_rank + mla.q_lora_rank * q_dim
        else:
            q = h * q_dim
        latent = mla.kv_lora_rank
        kv = h * (latent + mla.qk_rope_head_dim) + latent
        kv += latent * heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        return q + kv + heads * mla.v_head_dim * h
    if layer_kind == LINEAR:
        lin = spec.linear
        kdim = lin.num_key_heads * lin.key_head_dim
        vdim = lin.num_value_heads * lin.value_head_dim
        vh = lin.num_value_heads
        conv = (2 * kdim + vdim) * lin.conv_kernel_dim
        return (
            h * (2 * kdim + 2 * vdim)
            + h * 2 * vh
            + conv
            + 2 * vh
            + lin.value_head_dim
            + vdim * h
        )
    if layer_kind in (CONV, MAMBA):
        return _state_mixer_params(spec, layer_kind)
    if layer_kind not in (FULL, SLIDING):
        raise ValueError(f"unknown layer kind {layer_kind!r}")
    q_out = heads * hd * (2 if spec.attention.output_gate else 1)
    kv_out = spec.num_kv_heads * hd
    att = spec.attention
    total = _linear(h, q_out, att.qkv_bias) + 2 * _linear(h, kv_out, att.qkv_bias)
    total += _linear(heads * hd, h, att.o_bias)
    if att.qk_norm:
        total += (heads + spec.num_kv_heads) * hd if att.qk_norm_full_width else 2 * hd
    return total + (heads if att.sinks else 0)


def _state_mixer_params(spec: ModelSpec, layer_kind: str) -> int:
    """LFM2's gated short convolution (in_proj to B, C, x; a depthwise convolution; out_proj)
    or a Mamba-2 mixer (in_proj to z, x, B, C, dt; the convolution; dt bias, A, D; the gated
    RMSNorm; out_proj)."""
    h, state = spec.hidden_size, spec.state
    conv = state.conv_dim * state.conv_kernel + (state.conv_dim if state.conv_bias else 0)
    if layer_kind == CONV:
        return _linear(h, 3 * h, state.conv_bias) + conv + _linear(h, h, state.conv_bias)
    m = spec.mamba
    inner = m.num_heads * m.head_dim
    in_proj = _linear(h, inner + state.conv_dim + m.num_heads, m.proj_bias)
    return in_proj + conv + 3 * m.num_heads + inner + _linear(inner, h, m.proj_bias)


def _moe_params(spec: ModelSpec, experts: int) -> int:
    """One MoE block with ``experts`` routed experts in use (all of them for the total)."""
    h = spec.hidden_size
    group = spec.experts
    routed = experts * _mlp(spec, group.intermediate_size)
    shared = group.shared_count * _mlp(spec, group.shared_intermediate_size)
    router = _linear(h, group.count, group.router_bias)
    return routed + shared + router + (h if group.shared_gate else 0)


def count_params(spec: ModelSpec) -> ParamCount:
    """Total and active parameters of ``spec`` (see the module docstring for what counts).

    For a GGUF spec the total is the file's tensor element count; active is derived the same
    way as for a config (equal to total for dense models).
    """
    h = spec.hidden_size
    norm = h * (2 if spec.norm.bias else 1)
    embedding = spec.vocab_size * h + spec.position_embeddings * h
    lm_head = 0 if spec.tie_word_embeddings else spec.vocab_size * h
    common = embedding + lm_head + norm
    common += sum(
        attention_params(spec, kind) + spec.norm.per_layer * norm for kind in spec.layers.types
    )
    moe_layers = spec.num_layers - len(spec.experts.mlp_only_layers) if spec.is_moe else 0
    dense = (spec.num_layers - moe_layers) * _mlp(spec, spec.intermediate_size)
    total = active = common + dense
    if spec.is_moe:
        total += moe_layers * _moe_params(spec, spec.experts.count)
        active += moe_layers * _moe_params(spec, spec.experts.per_token)
    if spec.gguf is not None:
        active += spec.gguf.tensor_elements - total
        total = spec.gguf.tensor_elements
    return ParamCount(total=total, active=active, embedding=embedding, lm_head=lm_head)


def params_read_per_step(spec: ModelSpec, batch: int = 1) -> int:
    """Parameters one decode step of ``batch`` sequences reads from memory.

    Dense models read every weight. An MoE layer reads the experts its tokens are routed to:
    with uniform routing the expected number of distinct experts touched by ``batch`` tokens
    choosing ``k`` of ``E`` is ``E x (1 - (1 - k/E)^batch)`` (k at batch 1, -> E as it grows).
    """
    p = count_params(spec)
    if not spec.is_moe:
        return p.total
    e, k = spec.experts.count, spec.experts.per_token
    touched = e * (1 - (1 - k / e) ** batch)
    per_expert = (p.total - p.active) / (e - k)
    return round(p.active + (touched - k) * per_expert)


def weight_bytes(params: int, dtype: str, group_size: int = DEFAULT_WEIGHT_GROUP) -> int:
    """Bytes of ``params`` weights stored as ``dtype`` (group scales included for int8/int4).

    Raises:
        InvalidParameterError: unknown dtype or non-positive group size.
    """
    if dtype not in _BITS:
        raise InvalidParameterError(
            f"unknown weights dtype {dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}"
        )
    if group_size <= 0:
        raise InvalidParameterError(f"weight group size must be positive, got {group_size}")
    meta = _GROUP_META_BYTES.get(dtype, 0) * math.ceil(params / group_size)
    return math.ceil(params * _BITS[dtype] / 8) + meta


def spec_weight_bytes(spec: ModelSpec, dtype: str | None = None) -> int:
    """Weight bytes of a model: the GGUF file's real tensor bytes when ``dtype`` is None and the
    spec comes from a GGUF, else :func:`weight_bytes` of its total parameters in ``dtype``
    (default: the checkpoint's ``weights_dtype``)."""
    if dtype is None and spec.gguf is not None:
        return spec.gguf.tensor_bytes
    return weight_bytes(count_params(spec).total, dtype or spec.weights_dtype)
