"""The field groups of a ModelSpec: one small frozen dataclass per concept of the architecture.

:class:`~kvledger.spec.model_spec.ModelSpec` keeps the core counts itself and holds one group
per concept: ``attention``, ``rope``, ``layers`` (kinds and window), ``mlp`` and ``norm``
always; ``experts``, ``latent``, ``linear``, ``state``, ``mamba``, ``mup`` and ``gguf`` only
when the model has them (None for a dense model, a model without MLA, without gated DeltaNet,
without state layers, without Mamba-2 layers, without µP multipliers, a config.json): an optional group is None exactly when
every one of its fields keeps its default. The readers set ``latent`` for ``mla`` layers,
``linear`` for ``linear_attention`` layers, ``mamba`` for ``mamba`` layers and ``state`` for
every state kind; code that reads them under those layer kinds relies on it (``ModelSpec``
checks the ``state`` group).

Every field of a group also has a flat name, the Hugging Face spelling the readers build a
spec from and the JSON of a spec uses (:data:`FLAT_NAMES`). Every field has a default, so an
absent optional group reads as its default values in the flat form.

Layer kinds (``LayerKinds.types``), one entry per decoder layer:
  ``full_attention``    K and V for every token (MHA/GQA/MQA)
  ``sliding_attention`` K and V for the last ``sliding_window`` tokens only
  ``mla``               one compressed latent of ``kv_lora_rank + qk_rope_head_dim`` per token
                        (DeepSeek-V2, arXiv:2405.04434 §2.1)
  ``linear_attention``  gated DeltaNet: a fixed per-sequence state, independent of length
                        (Qwen3-Next, Qwen3.5)
  ``conv``              a gated short convolution: its last ``kernel - 1`` inputs (LFM2)
  ``mamba``             a Mamba-2 (SSD) mixer: its convolution window and SSM state (Granite-4.0-H)

The last three are the *state* kinds (:data:`STATE_KINDS`): each layer keeps one fixed state per
sequence, described by the ``state`` group (:class:`State`: the causal convolution's window
and the recurrent state's shape), nothing per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FULL = "full_attention"
SLIDING = "sliding_attention"
MLA = "mla"
LINEAR = "linear_attention"
CONV = "conv"
MAMBA = "mamba"
STATE_KINDS = (LINEAR, CONV, MAMBA)
"""The layer kinds that keep a fixed per-sequence state instead of per-token K and V."""


@dataclass(frozen=True)
class Attention:
    """Options of the attention block beyond plain scaled dot-product GQA."""

    query_pre_attn_scalar: float | None = None  # scores scaled by its -0.5 power (Gemma)
    logit_softcapping: float | None = None  # scores -> c * tanh(s / c) (Gemma 2)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    qk_norm_full_width: bool = False  # ... over the whole projection instead (OLMo 2 / 3)
    output_gate: bool = False  # q_proj also emits a sigmoid gate (Qwen3-Next)
    sinks: bool = False  # one learned sink logit per head, no KV (gpt-oss)
    qkv_bias: bool = False
    o_bias: bool = False
    multiplier: float | None = None  # the factor of q . k itself (Granite's µP
    # ``attention_multiplier``), in place of head_dim ** -0.5


@dataclass(frozen=True)
class Rope:
    """Rotary position embedding (Su et al., 2021) as the full-attention layers apply it."""

    theta: float = 10000.0
    scaling: dict | None = None  # HF names, ``rope_type`` always set; full layers only when
    # ``local_base_freq`` is set (Gemma 3)
    local_base_freq: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    partial_rotary_factor: float = 1.0  # share of head_dim RoPE turns (Phi-4-mini: 0.75)
    position_embedding_type: str = "rope"  # "nope": no rotary on any layer (Granite-4.0-H)


@dataclass(frozen=True)
class LayerKinds:
    """One kind per decoder layer (``layer_types``) and the window of the sliding ones.

    ModelSpec fills ``types`` with full attention on every layer when none are given.
    """

    types: tuple[str, ...] = ()
    sliding_window: int | None = None  # W: query i sees key j when i - j < W

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer, the sliding window W of a sliding layer, else None (full attention)."""
        return tuple(self.sliding_window if kind == SLIDING else None for kind in self.types)


@dataclass(frozen=True)
class Mlp:
    """The dense MLP (and the experts' projections)."""

    act: str = "silu"  # an ACT2FN name (Gemma: gelu_pytorch_tanh)
    gated: bool = True  # SwiGLU/GeGLU: gate, up, down; False: up, down (GPT-2, GPT-NeoX)
    bias: bool = False  # biases on MLP / expert projections


@dataclass(frozen=True)
class Norm:
    """The layer norms."""

    eps: float = 1e-5
    bias: bool = False  # LayerNorm (weight + bias) instead of RMSNorm (weight only)
    per_layer: int = 2  # Gemma 2/3: 4 (pre and post norm around attention and MLP)


@dataclass(frozen=True)
class Experts:
    """Mixture of experts: routed experts, an optional shared expert, the router's options."""

    count: int = 0
    per_token: int = 0
    intermediate_size: int = 0
    shared_count: int = 0
    shared_intermediate_size: int = 0
    shared_gate: bool = False  # sigmoid gate on the shared expert (Qwen2-MoE family)
    mlp_only_layers: tuple[int, ...] = ()  # the layers with a dense MLP instead of experts
    # (Qwen-MoE: mlp_only_layers and decoder_sparse_step; DeepSeek: the first k)
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum 1 (Mixtral,
    # gpt-oss: always; Qwen-MoE: its config's norm_topk_prob)
    router_bias: bool = False  # per-expert router bias (gpt-oss, DeepSeek-V3 score correction)
    routed_scaling_factor: float = 1.0  # the routed experts' weights multiplied by it (DeepSeek)
    topk_method: str = "greedy"  # DeepSeek: "greedy" top-k, or "group_limited_greedy" (the
    # top-k among the experts of the ``topk_group`` groups, of ``n_group``, with the highest max)
    n_group: int = 0
    topk_group: int = 0
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit
    swiglu_alpha: float | None = None  # ... and its sigmoid gain, gate * sigmoid(alpha * gate)


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 §2.1): one compressed latent
    of ``kv_lora_rank + qk_rope_head_dim`` per token."""

    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): their heads; their state is the ``state``
    group's (recurrent value_heads x key_head_dim x value_head_dim, a convolution over
    2 x key_heads x key_head_dim + value_heads x value_head_dim channels)."""

    num_key_heads: int = 0
    num_value_heads: int = 0
    key_head_dim: int = 0
    value_head_dim: int = 0
    conv_kernel_dim: int = 0


@dataclass(frozen=True)
class State:
    """The fixed state one state layer (:data:`STATE_KINDS`) keeps per sequence: the causal
    depthwise convolution's last ``conv_kernel - 1`` inputs over ``conv_dim`` channels, and the
    recurrent state of shape ``recurrent_shape`` (empty: none, LFM2's short convolution)."""

    conv_dim: int = 0
    conv_kernel: int = 0
    recurrent_shape: tuple[int, ...] = ()
    conv_bias: bool = False

    @property
    def conv_elements(self) -> int:
        """Elements of the convolution window: ``conv_dim x (conv_kernel - 1)``."""
        return self.conv_dim * max(self.conv_kernel - 1, 0)

    @property
    def recurrent_elements(self) -> int:
        """Elements of the recurrent state (0 when it has none)."""
        return math.prod(self.recurrent_shape) if self.recurrent_shape else 0

    @property
    def elements(self) -> int:
        """Elements of one layer's state of one sequence."""
        return self.conv_elements + self.recurrent_elements


@dataclass(frozen=True)
class Mamba:
    """Mamba-2 (SSD) mixers (Dao & Gu, arXiv:2405.21060; Granite-4.0-H): ``num_heads`` heads
    of ``head_dim`` over an inner size ``num_heads x head_dim``, B and C of ``state_size`` in
    ``n_groups`` groups, the scan in chunks of ``chunk_size``."""

    num_heads: int = 0
    head_dim: int = 0
    state_size: int = 0
    n_groups: int = 0
    chunk_size: int = 0
    proj_bias: bool = False
    time_step_limit: tuple[float, float | None] = (0.0, None)  # dt clamped to [lo, hi]
    # after its softplus (transformers' ``time_step_limit``; None: no upper bound)


@dataclass(frozen=True)
class MuP:
    """The µP multipliers (Yang et al., "Tensor Programs V", arXiv:2203.03466; Granite's
    config): the embedding rows times ``embedding_multiplier``, each block's output times
    ``residual_multiplier`` before it joins the residual stream, the logits divided by
    ``logits_scaling``. (The attention's own factor is ``Attention.multiplier``.)"""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0


@dataclass(frozen=True)
class GgufFacts:
    """What a GGUF file really holds, summed over its tensors."""

    tensor_elements: int | None = None
    tensor_bytes: int | None = None


GROUPS: dict[str, type] = {
    "attention": Attention, "rope": Rope, "layers": LayerKinds, "mlp": Mlp, "norm": Norm,
    "experts": Experts, "latent": Latent, "linear": LinearAttention, "state": State,
    "mamba": Mamba, "mup": MuP, "gguf": GgufFacts}
"""ModelSpec attribute -> its group's type."""
OPTIONAL = frozenset({"experts", "latent", "linear", "state", "mamba", "mup", "gguf"})
"""The groups that are None when every field has its default (a model without them)."""

FLAT_NAMES: dict[str, tuple[str, str]] = {
    "query_pre_attn_scalar": ("attention", "query_pre_attn_scalar"),
    "attn_logit_softcapping": ("attention", "logit_softcapping"),
    "qk_norm": ("attention", "qk_norm"),
    "qk_norm_full_width": ("attention", "qk_norm_full_width"),
    "attn_output_gate": ("attention", "output_gate"),
    "attention_sinks": ("attention", "sinks"),
    "qkv_bias": ("attention", "qkv_bias"),
    "o_bias": ("attention", "o_bias"),
    "attention_multiplier": ("attention", "multiplier"),
    "rope_theta": ("rope", "theta"),
    "rope_scaling": ("rope", "scaling"),
    "rope_local_base_freq": ("rope", "local_base_freq"),
    "partial_rotary_factor": ("rope", "partial_rotary_factor"),
    "position_embedding_type": ("rope", "position_embedding_type"),
    "layer_types": ("layers", "types"),
    "sliding_window": ("layers", "sliding_window"),
    "hidden_act": ("mlp", "act"),
    "mlp_gated": ("mlp", "gated"),
    "mlp_bias": ("mlp", "bias"),
    "rms_norm_eps": ("norm", "eps"),
    "norm_bias": ("norm", "bias"),
    "norms_per_layer": ("norm", "per_layer"),
    "num_experts": ("experts", "count"),
    "num_experts_per_tok": ("experts", "per_token"),
    "moe_intermediate_size": ("experts", "intermediate_size"),
    "num_shared_experts": ("experts", "shared_count"),
    "shared_expert_intermediate_size": ("experts", "shared_intermediate_size"),
    "shared_expert_gate": ("experts", "shared_gate"),
    "mlp_only_layers": ("experts", "mlp_only_layers"),
    "norm_topk_prob": ("experts", "norm_topk_prob"),
    "router_bias": ("experts", "router_bias"),
    "routed_scaling_factor": ("experts", "routed_scaling_factor"),
    "topk_method": ("experts", "topk_method"),
    "n_group": ("experts", "n_group"),
    "topk_group": ("experts", "topk_group"),
    "swiglu_limit": ("experts", "swiglu_limit"),
    "swiglu_alpha": ("experts", "swiglu_alpha"),
    "kv_lora_rank": ("latent", "kv_lora_rank"),
    "q_lora_rank": ("latent", "q_lora_rank"),
    "qk_rope_head_dim": ("latent", "qk_rope_head_dim"),
    "qk_nope_head_dim": ("latent", "qk_nope_head_dim"),
    "v_head_dim": ("latent", "v_head_dim"),
    "linear_num_key_heads": ("linear", "num_key_heads"),
    "linear_num_value_heads": ("linear", "num_value_heads"),
    "linear_key_head_dim": ("linear", "key_head_dim"),
    "linear_value_head_dim": ("linear", "value_head_dim"),
    "linear_conv_kernel_dim": ("linear", "conv_kernel_dim"),
    "state_conv_dim": ("state", "conv_dim"),
    "state_conv_kernel": ("state", "conv_kernel"),
    "state_recurrent_shape": ("state", "recurrent_shape"),
    "state_conv_bias": ("state", "conv_bias"),
    "mamba_num_heads": ("mamba", "num_heads"),
    "mamba_head_dim": ("mamba", "head_dim"),
    "mamba_state_size": ("mamba", "state_size"),
    "mamba_n_groups": ("mamba", "n_groups"),
    "mamba_chunk_size": ("mamba", "chunk_size"),
    "mamba_proj_bias": ("mamba", "proj_bias"),
    "time_step_limit": ("mamba", "time_step_limit"),
    "embedding_multiplier": ("mup", "embedding_multiplier"),
    "residual_multiplier": ("mup", "residual_multiplier"),
    "logits_scaling": ("mup", "logits_scaling"),
    "gguf_tensor_elements": ("gguf", "tensor_elements"),
    "gguf_tensor_bytes": ("gguf", "tensor_bytes"),
}
"""Flat name (the readers' and the JSON's, Hugging Face spelling) -> (group, field)."""
