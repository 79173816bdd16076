"""Granite-4.0-H (``granitemoehybrid``, transformers' ``GraniteMoeHybridForCausalLM``): read for
`kvledger plan`; the engine refuses it until its forward runs.

Mamba-2 (SSD) layers (Dao & Gu, arXiv:2405.21060) beside a few GQA attention layers
(``layer_types``: ``mamba`` / ``attention``, transformers 4's ``layers_block_type``), each with
a shared MLP of ``shared_intermediate_size`` and, on the MoE models (``num_local_experts`` > 0),
routed experts of ``intermediate_size``. A Mamba-2 layer of ``mamba_n_heads`` heads of
``mamba_d_head`` (``"auto"``: ``mamba_expand x hidden / heads``) keeps per sequence the SSM state
heads x d_head x ``mamba_d_state`` and the convolution's last ``mamba_d_conv - 1`` inputs over
inner + 2 x ``mamba_n_groups`` x d_state channels. Not read yet (the engine refuses the family):
the µP multipliers (embedding, residual, attention, logits) and ``position_embedding_type``.

GGUF (llama.cpp's converter, ``granitehybrid``): ``ssm.conv_kernel``, ``ssm.state_size``,
``ssm.group_count``, ``ssm.inner_size``, ``ssm.time_step_rank`` (the heads),
``attention.head_count_kv`` per layer (0 on a Mamba layer),
``expert_shared_feed_forward_length``.
"""

from __future__ import annotations

from kvledger.errors import ConfigError
from kvledger.model.families.moe import experts_key
from kvledger.spec import FULL, MAMBA, Config, Family

_DEFAULTS = {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
             "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2,
             "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
             "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024,
             "rms_norm_eps": 1e-6}
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
               "state_conv_bias": bool(c.get("mamba_conv_bias"))}
    shared = c.int("shared_intermediate_size")
    experts = int(c.get(experts_key(c)) or 0)
    fields["intermediate_size"] = shared
    if experts:
        fields |= {"num_experts": experts, "num_experts_per_tok": c.int("num_experts_per_tok"),
                   "moe_intermediate_size": c.int("intermediate_size"),
                   "num_shared_experts": 1, "shared_expert_intermediate_size": shared,
                   "norm_topk_prob": True}
    return fields


def _layer_types(c: Config, n: int) -> tuple[str, ...]:
    return (MAMBA,) * n  # transformers' default when a config lists none


_GGUF_NAMES = {"heads": "ssm.time_step_rank", "head_dim": "ssm.inner_size",
               "state": "ssm.state_size", "groups": "ssm.group_count",
               "kernel": "ssm.conv_kernel"}


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
            "state_conv_bias": any(".ssm_conv1d.bias" in t for t in header.tensor_names)}
    shared = header.value("expert_shared_feed_forward_length")
    if shared:
        out["intermediate_size"] = int(shared)
        if fields.get("num_experts"):
            out |= {"num_shared_experts": 1, "shared_expert_intermediate_size": int(shared)}
    return out


FAMILY = Family(
    name="granitehybrid",
    model_types=("granitemoehybrid",),
    what="Mamba-2 layers beside GQA attention, shared and routed experts",
    config_prepare=_prepare,
    config_defaults={"granitemoehybrid": _DEFAULTS},
    config_fields=_config_fields,
    layer_types=_layer_types,
    gguf_archs={"granitehybrid": "granitemoehybrid"},
    gguf_fields=_gguf_fields,
)
