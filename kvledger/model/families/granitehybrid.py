"""Granite-4.0-H (``granitemoehybrid``, transformers' ``GraniteMoeHybridForCausalLM``): Mamba-2
layers beside a few GQA attention layers, a shared MLP on every layer and, on the MoE models,
routed experts beside it; µP multipliers throughout. The dense Granite 4.0 models (attention
on every layer, RoPE) are the same model type.

Mamba-2 (SSD) layers (Dao & Gu, arXiv:2405.21060; :class:`~kvledger.model.layers.mamba2.Mamba2`)
beside GQA attention layers (``layer_types``: ``mamba`` / ``attention`` in the hub files,
transformers 5's ``linear_attention`` / ``full_attention``; transformers 4's
``layers_block_type``). A Mamba-2 layer of ``mamba_n_heads`` heads of ``mamba_d_head``
(``"auto"``: ``mamba_expand x hidden / heads``) keeps per sequence the SSM state heads x d_head
x ``mamba_d_state`` and the convolution's last ``mamba_d_conv - 1`` inputs over inner + 2 x
``mamba_n_groups`` x d_state channels; its dt is clamped to ``time_step_limit`` (default 0 to
infinity; transformers 5 writes infinity as ``{"__float__": "Infinity"}``).

The forward, as transformers 5.25's ``GraniteMoeHybridModel`` computes it:

- the embedding rows times ``embedding_multiplier``; each layer's mixer output and MLP output
  times ``residual_multiplier`` before they join the residual stream; the logits divided by
  ``logits_scaling`` (``ModelSpec.mup``);
- attention with the softmax scale ``attention_multiplier`` itself (not head_dim ** -0.5) and
  RoPE only when ``position_embedding_type`` is ``"rope"`` (the H models say ``"nope"``;
  transformers' default, None, is no RoPE too);
- the MLP: the shared MLP ``shared_mlp`` (SwiGLU of ``shared_intermediate_size``, its
  ``input_linear`` the gate rows then the up rows) alone when ``num_local_experts`` is 0 (the
  spec's dense MLP), else the routed experts (``block_sparse_moe``: softmax over the top
  ``num_experts_per_tok`` router logits, experts of ``intermediate_size``) plus the shared MLP
  (the spec's one shared expert): :class:`~kvledger.model.layers.experts.Experts`.

Checkpoint names -> the common ones: ``shared_mlp.input_linear`` -> ``mlp.gate_proj`` /
``up_proj`` (an MoE model's ``mlp.shared_experts.*``), ``shared_mlp.output_linear`` ->
``down_proj``; ``block_sparse_moe.router.layer`` -> ``mlp.gate``;
``block_sparse_moe.input_linear`` [experts, 2 x f, hidden] / ``output_linear`` [experts,
hidden, f] -> the stacked ``mlp.experts.{gate,up,down}_proj`` (split per expert by
``names.to_common_names``); the Mamba layer's ``mamba.*`` stay.

GGUF (llama.cpp's converter, ``granitehybrid``, ``conversion/granite.py`` and ``mamba.py``):
``ssm.conv_kernel``, ``ssm.state_size``, ``ssm.group_count``, ``ssm.inner_size``,
``ssm.time_step_rank`` (the heads), ``attention.head_count_kv`` per layer (0 on a Mamba layer),
``expert_shared_feed_forward_length``; the multipliers as ``embedding_scale``,
``residual_scale``, ``attention.scale`` and ``logit_scale``; RoPE only when
``rope.scaling.finetuned`` (the converter's ``use_rope``: Bamba, not Granite-4.0-H). Its
tensors: ``ssm_in`` / ``ssm_out``, ``ssm_conv1d`` (the taps squeezed to [channels, taps]),
``ssm_a`` holding ``-exp(A_log)`` and ``ssm_d`` (both [heads, 1], no ``.weight``), ``ssm_dt``'s
bias (dt_bias), ``ssm_norm`` as [groups, inner / groups]; the shared MLP as ``ffn_*_shexp``
(a dense model's as ``ffn_gate`` / ``ffn_up`` / ``ffn_down``), the experts' gate and up split
into ``ffn_gate_exps`` / ``ffn_up_exps``; q / k rows permuted for ggml's rope, as Llama's.
All brought back to the checkpoint's form when loaded (:func:`_gguf_weights`).
"""

from __future__ import annotations

from functools import cache

from kvledger.errors import ConfigError
from kvledger.model.families.moe import experts_key
from kvledger.spec import FULL, MAMBA, Config, Family, ModelSpec, any_value

_DEFAULTS = {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
             "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2,
             "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
             "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024,
             "rms_norm_eps": 1e-6, "embedding_multiplier": 1.0, "attention_multiplier": 1.0,
             "residual_multiplier": 1.0, "logits_scaling": 1.0, "tie_word_embeddings": False}
"""transformers 5.25's ``GraniteMoeHybridConfig`` defaults of the keys a config may omit."""
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": FULL}
"""The config's layer kinds (the hub files' ``mamba`` / ``attention``, transformers 5's
``linear_attention`` for a Mamba layer) -> the spec's."""


def mamba_fields(hidden: int, heads: int, head_dim: int, state: int, groups: int, kernel: int,
                 where, names: dict[str, str]) -> dict:
    """The ``mamba`` and ``state`` fields of Mamba-2 layers; ``names`` spell the fields in
    errors (the config's or the GGUF's keys).

    Raises:
        ConfigError: a size below 1, heads x head_dim not the inner size, heads not a multiple
            of the groups, a kernel below 2; naming the field.
    """
    for key, value in (("heads", heads), ("head_dim", head_dim), ("state", state),
                       ("groups", groups)):
        if value < 1:
            raise ConfigError(f"{where}: {names[key]!r} must be >= 1, got {value}")
    if heads % groups:
        raise ConfigError(f"{where}: {names['heads']!r} ({heads}) must be a multiple of "
                          f"{names['groups']!r} ({groups})")
    if kernel < 2:
        raise ConfigError(f"{where}: {names['kernel']!r} must be >= 2, got {kernel}")
    inner = heads * head_dim
    return {"mamba_num_heads": heads, "mamba_head_dim": head_dim, "mamba_state_size": state,
            "mamba_n_groups": groups, "state_conv_dim": inner + 2 * groups * state,
            "state_conv_kernel": kernel, "state_recurrent_shape": (heads, head_dim, state)}


_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                "logits_scaling")
"""The µP multipliers, by the config's (and the spec's) names."""
_CONFIG_NAMES = {"heads": "mamba_n_heads", "head_dim": "mamba_d_head", "state": "mamba_d_state",
                 "groups": "mamba_n_groups", "kernel": "mamba_d_conv"}


def _prepare(cfg: dict) -> dict:
    out = dict(cfg)
    kinds = out.get("layer_types") or out.get("layers_block_type")
    if isinstance(kinds, list):
        out["layer_types"] = [_KINDS.get(k, k) for k in kinds]
    return out


def _config_fields(c: Config, n: int) -> dict:
    hidden, heads = c.int("hidden_size"), c.int("mamba_n_heads")
    inner = c.int("mamba_expand") * hidden
    head_dim = c.get("mamba_d_head")
    head_dim = inner // heads if head_dim == "auto" and heads > 0 else c.int("mamba_d_head")
    if heads * head_dim != inner:
        raise ConfigError(f"{c.path}: 'mamba_n_heads' x 'mamba_d_head' ({heads} x {head_dim}) "
                          f"must equal 'mamba_expand' x 'hidden_size' ({inner})")
    fields = mamba_fields(hidden, heads, head_dim, c.int("mamba_d_state"),
                          c.int("mamba_n_groups"), c.int("mamba_d_conv"), c.path, _CONFIG_NAMES)
    fields |= {"mamba_chunk_size": c.int("mamba_chunk_size"),
               "mamba_proj_bias": bool(c.get("mamba_proj_bias")),
               "state_conv_bias": bool(c.get("mamba_conv_bias")),
               "position_embedding_type": "rope" if c.get("position_embedding_type") == "rope"
               else "nope"}
    fields |= {key: c.number(key) for key in _MULTIPLIERS}
    fields["time_step_limit"] = _time_step_limit(c)
    shared = c.int("shared_intermediate_size")
    experts = int(c.get(experts_key(c)) or 0)
    fields["intermediate_size"] = shared
    if experts:
        fields |= {"num_experts": experts, "num_experts_per_tok": c.int("num_experts_per_tok"),
                   "moe_intermediate_size": c.int("intermediate_size"),
                   "num_shared_experts": 1, "shared_expert_intermediate_size": shared,
                   "norm_topk_prob": True}
    return fields


def _bound(x) -> float | None:
    """A bound of ``time_step_limit`` as a float (None: infinity, also transformers 5's
    ``{"__float__": "Infinity"}``); NaN for what is no number."""
    if isinstance(x, dict) and set(x) == {"__float__"}:
        return None if x["__float__"] == "Infinity" else float("nan")
    if x is None or x == float("inf"):
        return None
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else float("nan")


def _time_step_limit(c: Config) -> tuple[float, float | None]:
    """``time_step_limit`` as (lo, hi; None: no upper bound).

    Raises:
        ConfigError: not two numbers with 0 <= lo <= hi, naming the key.
    """
    value = c.get("time_step_limit", [0.0, None])
    lo, hi = (_bound(x) for x in value) if isinstance(value, list) and len(value) == 2 \
        else (float("nan"), None)
    if lo is None or not 0 <= lo <= (float("inf") if hi is None else hi):
        raise ConfigError(f"{c.path}: 'time_step_limit' must be two numbers 0 <= lo <= hi, "
                          f"got {value!r}")
    return lo, hi


def _layer_types(c: Config, n: int) -> tuple[str, ...]:
    return (MAMBA,) * n  # transformers' default when a config lists none


_GGUF_NAMES = {"heads": "ssm.time_step_rank", "head_dim": "ssm.inner_size",
               "state": "ssm.state_size", "groups": "ssm.group_count",
               "kernel": "ssm.conv_kernel"}


_GGUF_MULTIPLIERS = {"embedding_multiplier": "embedding_scale",
                     "residual_multiplier": "residual_scale",
                     "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
"""The µP multipliers -> the GGUF keys the converter writes them under (when set)."""


def _gguf_fields(header, fields: dict) -> dict:
    got = {}
    for key, name in _GGUF_NAMES.items():
        value = header.value(name)
        if value is None:
            raise ConfigError(f"GGUF file {header.path} lacks the required key "
                              f"'{header.arch}.{name}'")
        got[key] = int(value)
    n, kv = fields["num_layers"], header.value("attention.head_count_kv")
    if not isinstance(kv, list) or len(kv) != n:
        raise ConfigError(f"GGUF file {header.path}: '{header.arch}.attention.head_count_kv' "
                          f"must list {n} per-layer counts (0 on a Mamba layer)")
    heads, inner = got["heads"], got["head_dim"]
    if heads < 1 or inner % heads:
        raise ConfigError(f"GGUF file {header.path}: '{header.arch}.ssm.inner_size' ({inner}) "
                          f"is not a multiple of '{header.arch}.ssm.time_step_rank' ({heads})")
    out = mamba_fields(fields["hidden_size"], heads, inner // heads, got["state"],
                       got["groups"], got["kernel"], header.path,
                       {k: f"{header.arch}.{v}" for k, v in _GGUF_NAMES.items()})
    out |= {"layer_types": tuple(FULL if h else MAMBA for h in kv), "num_kv_heads": max(kv),
            "state_conv_bias": any(".ssm_conv1d.bias" in t for t in header.tensor_names),
            "mamba_proj_bias": any(".ssm_in.bias" in t for t in header.tensor_names),
            "position_embedding_type": "rope" if header.value("rope.scaling.finetuned")
            else "nope"}
    for field, key in _GGUF_MULTIPLIERS.items():
        value = header.value(key)
        if value is not None:
            out[field] = float(value)
    shared = header.value("expert_shared_feed_forward_length")
    if shared:
        out["intermediate_size"] = int(shared)
        if fields.get("num_experts"):
            out |= {"num_shared_experts": 1, "shared_expert_intermediate_size": int(shared)}
    return out


def _weight_names(state: dict, spec: ModelSpec) -> None:
    """Granite's checkpoint names -> the common ones (module docstring); a GGUF's tensors
    brought back to the checkpoint's form first (:func:`_gguf_weights`)."""
    if spec.extra.get("gguf_architecture"):
        _gguf_weights(state)
        return
    shared = "mlp.shared_experts." if spec.is_moe else "mlp."
    for name in list(state):
        stem, found, rest = name.partition("shared_mlp.")
        if found:
            if rest.startswith("input_linear."):
                gate, up = state.pop(name).chunk(2, 0)
                suffix = rest.removeprefix("input_linear.")
                state[f"{stem}{shared}gate_proj.{suffix}"] = gate
                state[f"{stem}{shared}up_proj.{suffix}"] = up
            else:
                state[f"{stem}{shared}down_proj.{rest.removeprefix('output_linear.')}"] = \
                    state.pop(name)
            continue
        stem, found, rest = name.partition("block_sparse_moe.")
        if not found:
            continue
        if rest.startswith("router.layer."):
            state[f"{stem}mlp.gate.{rest.removeprefix('router.layer.')}"] = state.pop(name)
        elif rest.startswith("input_linear."):
            gate, up = state.pop(name).chunk(2, 1)
            suffix = rest.removeprefix("input_linear.")
            state[f"{stem}mlp.experts.gate_proj.{suffix}"] = gate
            state[f"{stem}mlp.experts.up_proj.{suffix}"] = up
        elif rest.startswith("output_linear."):
            state[f"{stem}mlp.experts.down_proj.{rest.removeprefix('output_linear.')}"] = \
                state.pop(name)


def _gguf_weights(state: dict) -> None:
    """A ``granitehybrid`` GGUF's Mamba tensors as the checkpoint holds them: ``A_log`` from
    the stored ``-exp(A_log)``, ``D`` and the norm flat, ``dt_bias`` by its name, the conv
    taps [channels, 1, taps] (the rest already has the common names)."""
    for name in list(state):
        stem, found, rest = name.partition(".mamba.")
        if not found:
            continue
        if rest == "A_log":
            state[name] = (-state[name].double()).log().float().flatten()
        elif rest in ("D", "norm.weight"):
            state[name] = state[name].flatten()
        elif rest == "dt.bias":
            state[f"{stem}.mamba.dt_bias"] = state.pop(name)
        elif rest == "conv1d.weight" and state[name].ndim == 2:
            state[name] = state[name][:, None, :]


def _tensor_shapes(spec: ModelSpec, shapes: dict) -> dict:
    """A Mamba layer holds the Mamba-2 mixer's tensors instead of self-attention's."""
    h, m, conv = spec.hidden_size, spec.mamba, spec.state.conv_dim if spec.state else 0
    inner = m.num_heads * m.head_dim if m else 0
    for i, kind in enumerate(spec.layers.types):
        if kind != MAMBA:
            continue
        p = f"model.layers.{i}."
        shapes = {k: v for k, v in shapes.items() if not k.startswith(p + "self_attn.")}
        a = p + "mamba."
        shapes |= {a + "in_proj.weight": (inner + conv + m.num_heads, h),
                   a + "conv1d.weight": (conv, 1, spec.state.conv_kernel),
                   a + "A_log": (m.num_heads,), a + "D": (m.num_heads,),
                   a + "dt_bias": (m.num_heads,), a + "norm.weight": (inner,),
                   a + "out_proj.weight": (h, inner)}
        if spec.state.conv_bias:
            shapes[a + "conv1d.bias"] = (conv,)
        if m.proj_bias:
            shapes |= {a + "in_proj.bias": (inner + conv + m.num_heads,),
                       a + "out_proj.bias": (h,)}
    return shapes


@cache
def _model() -> type:
    import torch

    from kvledger.model.layers.decoder import Decoder
    from kvledger.model.layers.mamba2 import Mamba2, Mamba2Shape

    class GraniteHybridDecoder(Decoder):
        """The decoder with a Mamba-2 mixer on its ``mamba`` layers (the µP multipliers and
        the absent RoPE are the spec's, which the decoder reads)."""

        def state_mixer(self, w: dict[str, torch.Tensor], prefix: str, linear, i: int):
            spec, m = self.spec, self.spec.mamba
            lo, hi = m.time_step_limit
            shape = Mamba2Shape(spec.hidden_size, m.num_heads, m.head_dim, m.state_size,
                                m.n_groups, spec.state.conv_kernel, dt_min=lo,
                                dt_max=float("inf") if hi is None else hi, eps=spec.norm.eps)
            return Mamba2.from_weights(shape, w, prefix, linear, self.kernels)

    return GraniteHybridDecoder


_RUNS = {"layer_types": lambda kinds: set(kinds) <= {FULL, MAMBA}} | {
    name: any_value for name in (
    "position_embedding_type", *_MULTIPLIERS, "norm_topk_prob", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_shared_experts",
    "shared_expert_intermediate_size", "state_conv_dim", "state_conv_kernel",
    "state_recurrent_shape", "state_conv_bias", "mamba_num_heads", "mamba_head_dim",
    "mamba_state_size", "mamba_n_groups", "mamba_chunk_size", "mamba_proj_bias",
    "time_step_limit", "o_bias")}
"""What the forward computes: Mamba-2 and attention layers (with or without RoPE), the µP
multipliers, the shared MLP alone or beside top-k experts renormalised over the k."""


FAMILY = Family(
    name="granitehybrid",
    model_types=("granitemoehybrid",),
    what="Mamba-2 layers beside GQA attention, shared and routed experts",
    runs=_RUNS,
    config_prepare=_prepare,
    config_defaults={"granitemoehybrid": _DEFAULTS},
    config_fields=_config_fields,
    layer_types=_layer_types,
    gguf_archs={"granitehybrid": "granitemoehybrid"},
    gguf_fields=_gguf_fields,
    gguf_tensors={"ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d", "ssm_a": "mamba.A_log",
                  "ssm_d": "mamba.D", "ssm_dt": "mamba.dt", "ssm_norm": "mamba.norm",
                  "ssm_out": "mamba.out_proj", "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                  "ffn_up_shexp": "mlp.shared_experts.up_proj",
                  "ffn_down_shexp": "mlp.shared_experts.down_proj"},
    gguf_rope_permuted=frozenset({"granitehybrid"}),
    weight_names=_weight_names,
    tensor_shapes=_tensor_shapes,
    model=_model,
)
