"""ModelSpec: the model as the ledger and the engine see it (the data type, no reading).

One frozen dataclass holds the core counts of the decoder and one group per concept
(:mod:`.groups`: ``attention``, ``rope``, ``layers``, ``mlp``, ``norm``, and ``experts``,
``latent``, ``linear``, ``state``, ``mamba``, ``mup``, ``gguf`` when the model has them). The
readers beside this module build it from a source format with :meth:`ModelSpec.from_fields`, which takes the flat,
Hugging Face names (``num_experts``, ``rope_theta``, ...); :meth:`ModelSpec.as_fields` gives
them back (the JSON of a spec, the names a refusal shows). This module imports no reader.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvledger.errors import ConfigError
from kvledger.spec.groups import (
    FLAT_NAMES,
    FULL,
    GROUPS,
    MLA,
    OPTIONAL,
    SLIDING,
    STATE_KINDS,
    Attention,
    Experts,
    GgufFacts,
    Latent,
    LayerKinds,
    LinearAttention,
    Mamba,
    Mlp,
    MuP,
    Norm,
    Rope,
    State,
)
from kvledger.spec.ranges import check_spec_fields


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
    final_logit_softcapping: float | None = None  # logits -> c * tanh(z / c) (Gemma 2)
    position_embeddings: int = 0  # rows of a learned absolute position table (GPT-2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    weights_dtype: str = "bf16"  # native storage of the checkpoint's weights
    attention: Attention = field(default_factory=Attention)
    rope: Rope = field(default_factory=Rope)
    layers: LayerKinds = field(default_factory=LayerKinds)
    mlp: Mlp = field(default_factory=Mlp)
    norm: Norm = field(default_factory=Norm)
    experts: Experts | None = None  # None: a dense model
    latent: Latent | None = None  # None: no multi-head latent attention
    linear: LinearAttention | None = None  # None: no linear-attention layers
    state: State | None = None  # None: no state layers (``groups.STATE_KINDS``)
    mamba: Mamba | None = None  # None: no Mamba-2 layers
    mup: MuP | None = None  # None: no µP multipliers (all 1)
    gguf: GgufFacts | None = None  # None: read from a config.json
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        where = f" in {self.source}" if self.source else ""
        check_spec_fields(self.as_fields(), where)
        kinds = self.layers.types
        if MLA not in kinds and self.num_attention_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of the KV "
                f"heads ({self.num_kv_heads}){where}")
        if not kinds:
            kinds = (FULL,) * self.num_layers
            object.__setattr__(self, "layers", dataclasses.replace(self.layers, types=kinds))
        if len(kinds) != self.num_layers:
            raise ConfigError(f"{len(kinds)} layer types for {self.num_layers} layers{where}")
        if SLIDING in kinds and not self.layers.sliding_window:
            raise ConfigError(f"sliding layers need a sliding_window >= 1{where}")
        if any(kind in STATE_KINDS for kind in kinds):
            state = self.state or State()
            if state.conv_dim < 1:
                raise ConfigError(f"state layers need a state_conv_dim >= 1{where}")
            if state.conv_kernel < 2:
                raise ConfigError(f"state layers need a state_conv_kernel >= 2 (a convolution "
                                  f"window), got {state.conv_kernel}{where}")
        self._check_rotary_pairs(kinds, where)

    def _check_rotary_pairs(self, kinds: tuple[str, ...], where: str) -> None:
        """RoPE turns pairs of dimensions: an odd count of them has no forward."""
        if self.position_embeddings == 0 and self.rope.position_embedding_type == "rope" \
                and (FULL in kinds or SLIDING in kinds) and self.rotary_dim % 2:
            raise ConfigError(
                f"head_dim x partial_rotary_factor = {self.rotary_dim} rotary dimensions: "
                f"RoPE needs an even count (head_dim {self.head_dim}){where}")
        if MLA in kinds and self.latent is not None and self.latent.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even for RoPE, got "
                              f"{self.latent.qk_rope_head_dim}{where}")

    @property
    def state_layers(self) -> tuple[int, ...]:
        """Indices of the layers that keep a fixed state per sequence (``STATE_KINDS``)."""
        return tuple(i for i, kind in enumerate(self.layers.types) if kind in STATE_KINDS)

    @classmethod
    def from_fields(cls, **flat) -> ModelSpec:
        """The spec of flat fields: the core ones by their own names, a group's by its
        :data:`~kvledger.spec.groups.FLAT_NAMES` name (``num_experts=8`` ->
        ``experts.count``). An optional group whose fields all keep their defaults is None.

        Raises:
            TypeError: a name that is neither a core field nor a group's flat name.
        """
        parts: dict[str, dict] = {group: {} for group in GROUPS}
        core = {}
        for name, value in flat.items():
            if name in FLAT_NAMES:
                group, key = FLAT_NAMES[name]
                parts[group][key] = value
            else:
                core[name] = value
        for group, kind in GROUPS.items():
            made = kind(**parts[group])
            core[group] = None if group in OPTIONAL and made == kind() else made
        return cls(**core)

    def as_fields(self) -> dict:
        """Every field by its flat name (an absent group gives its defaults); the inverse of
        :meth:`from_fields`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in GROUPS}
        for name, (group, key) in FLAT_NAMES.items():
            out[name] = getattr(getattr(self, group) or GROUPS[group](), key)
        return out

    def with_fields(self, **changes) -> ModelSpec:
        """This spec with the flat fields ``changes`` set (validated again)."""
        return ModelSpec.from_fields(**(self.as_fields() | changes))

    @property
    def attention_scale(self) -> float:
        """The factor of q . k in attention: ``attention_multiplier`` when set (Granite's µP),
        else ``query_pre_attn_scalar ** -0.5`` when set, else ``head_dim ** -0.5`` (Vaswani et
        al., 2017)."""
        if self.attention.multiplier is not None:
            return self.attention.multiplier
        return (self.attention.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that RoPE turns (HF: ``head_dim x
        partial_rotary_factor``, truncated)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        """Whether the model routes to experts (on the layers :meth:`is_moe_layer` names)."""
        return self.experts is not None and self.experts.count > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes to experts (else its MLP is dense)."""
        return self.is_moe and layer not in self.experts.mlp_only_layers

    @property
    def gqa_group_size(self) -> int:
        """Query heads per KV head (1 = MHA, num_attention_heads = MQA)."""
        return self.num_attention_heads // self.num_kv_heads
