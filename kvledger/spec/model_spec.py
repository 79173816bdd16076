"""ModelSpec: the model as the ledger and the engine see it (the data type, no reading).

One frozen dataclass holds every architectural number the KV/weight ledger and the engine need.
The readers beside this module build it from a source format; this module imports none of them.

Layer kinds (``layer_types``), one entry per decoder layer:
  ``full_attention``    K and V for every token (MHA/GQA/MQA)
  ``sliding_attention`` K and V for the last ``sliding_window`` tokens only
  ``mla``               one compressed latent of ``kv_lora_rank + qk_rope_head_dim`` per token
                        (DeepSeek-V2, arXiv:2405.04434 §2.1)
  ``linear_attention``  a fixed per-sequence state, independent of length (Qwen3-Next)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.errors import ConfigError

FULL = "full_attention"
SLIDING = "sliding_attention"
MLA = "mla"
LINEAR = "linear_attention"


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers of a decoder-only transformer (counts, not bytes).

    Attributes use Hugging Face names where one exists. ``head_dim`` is always explicit (never
    assumed to be hidden/heads). ``eos_token_ids`` may hold several ids (chat end + eos).
    """

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF names, ``rope_type`` always set; full layers only
    # when ``rope_local_base_freq`` is set (Gemma 3)
    rope_local_base_freq: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    partial_rotary_factor: float = 1.0  # share of head_dim RoPE turns (Phi-4-mini: 0.75)
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # W: query i sees key j when i - j < W
    hidden_act: str = "silu"  # the MLP activation, an ACT2FN name (Gemma: gelu_pytorch_tanh)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -0.5 power (Gemma)
    attn_logit_softcapping: float | None = None  # scores -> c * tanh(s / c) (Gemma 2)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(z / c) (Gemma 2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    mlp_only_layers: tuple[int, ...] = ()  # MoE model: the layers with a dense MLP instead
    # of experts (Qwen-MoE: mlp_only_layers and decoder_sparse_step; DeepSeek: the first k)
    norm_topk_prob: bool = False  # the top-k routing weights renormalised to sum 1 (Mixtral,
    # gpt-oss: always; Qwen-MoE: its config's norm_topk_prob)
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU: gate <= limit, |up| <= limit
    swiglu_alpha: float | None = None  # ... and its sigmoid gain, gate * sigmoid(alpha * gate)
    routed_scaling_factor: float = 1.0  # the routed experts' weights multiplied by it (DeepSeek)
    topk_method: str = "greedy"  # DeepSeek: "greedy" top-k, or "group_limited_greedy" (the top-k
    # among the experts of the ``topk_group`` groups, of ``n_group``, with the highest maximum)
    n_group: int = 0
    topk_group: int = 0
    # layer structure beyond the Llama defaults (used by the parameter count)
    mlp_gated: bool = True  # SwiGLU/GeGLU: gate, up, down; False: up, down (GPT-2, GPT-NeoX)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False  # biases on MLP / expert projections
    norm_bias: bool = False  # LayerNorm (weight + bias) instead of RMSNorm (weight only)
    norms_per_layer: int = 2  # Gemma 2/3: 4 (pre and post norm around attention and MLP)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3, Gemma 3)
    qk_norm_full_width: bool = False  # ... over the whole projection instead (OLMo 2 / 3)
    attn_output_gate: bool = False  # q_proj also emits a sigmoid gate (Qwen3-Next)
    attention_sinks: bool = False  # one learned sink logit per head, no KV (gpt-oss)
    position_embeddings: int = 0  # rows of a learned absolute position table (GPT-2)
    router_bias: bool = False  # per-expert router bias (gpt-oss, DeepSeek-V3 score correction)
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert (Qwen2-MoE family)
    weights_dtype: str = "bf16"  # native storage of the checkpoint's weights
    # multi-head latent attention
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # linear-attention layers (Gated DeltaNet, Qwen3-Next): fixed per-sequence state, in
    # elements per layer = value_heads x key_head_dim x value_head_dim (recurrent matrix)
    # + (conv_kernel - 1) x (2 x key_heads x key_head_dim + value_heads x value_head_dim)
    linear_state_elements: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # what a GGUF file really holds (None for config.json)
    gguf_tensor_elements: int | None = None
    gguf_tensor_bytes: int | None = None
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = f" in {self.source}" if self.source else ""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}{where}")
        if MLA not in self.layer_types and self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of the KV "
                f"heads ({self.num_kv_heads}){where}")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"{len(self.layer_types)} layer types for {self.num_layers} "
                              f"layers{where}")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ConfigError(f"sliding layers need a sliding_window >= 1{where}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, the sliding window W of a sliding layer, else None (full attention)."""
        return tuple(self.sliding_window if kind == SLIDING else None
                     for kind in self.layer_types)

    @property
    def attention_scale(self) -> float:
        """The factor of q . k in attention: ``query_pre_attn_scalar ** -0.5`` when set, else
        ``head_dim ** -0.5`` (Vaswani et al., 2017)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that RoPE turns (HF: ``head_dim x
        partial_rotary_factor``, truncated)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes to experts (else its MLP is dense)."""
        return self.num_experts > 0 and layer not in self.mlp_only_layers

    @property
    def gqa_group_size(self) -> int:
        """Query heads per KV head (1 = MHA, num_attention_heads = MQA)."""
        return self.num_attention_heads // self.num_kv_heads
