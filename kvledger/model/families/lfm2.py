"""LFM2 (Liquid AI; transformers' ``Lfm2ForCausalLM``): gated short-convolution layers beside
GQA attention layers with per-head q / k RMSNorm, a SwiGLU MLP on every layer.

A ``conv`` layer (:class:`kvledger.model.layers.short_conv.ShortConv`): ``in_proj`` to B, C and
x (3 x hidden), ``y = C * conv(B * x)`` by a causal depthwise convolution of ``conv_L_cache``
taps, ``out_proj``. Per sequence it keeps the last ``conv_L_cache - 1`` values of ``B * x``
(hidden channels): its state (``state_conv_dim`` = hidden, no recurrent part).

Config: the layer kinds from ``layer_types`` (``conv`` / ``full_attention``) or
``full_attn_idxs``; ``norm_eps``; ``block_ff_dim`` (the older spelling of
``intermediate_size``) brought to the MLP's width as transformers' ``Lfm2MLP`` does when
``block_auto_adjust_ff_dim``: ``2/3`` of it, times ``block_ffn_dim_multiplier``, rounded up to
``block_multiple_of``; ``tie_embedding`` (older spelling); RoPE base 1e6 by default.

GGUF (llama.cpp's converter, ``lfm2``): ``attention.head_count_kv`` per layer, 0 on a conv
layer; ``shortconv.l_cache``; ``feed_forward_length`` already adjusted; the conv layer's
``shortconv.in_proj`` / ``shortconv.conv`` (its taps squeezed to [hidden, taps]) /
``shortconv.out_proj``, the final norm ``token_embd_norm``.

Checkpoint names -> the common ones: ``operator_norm`` / ``ffn_norm`` -> ``input_layernorm`` /
``post_attention_layernorm``, ``self_attn.out_proj`` -> ``o_proj``, ``q_layernorm`` /
``k_layernorm`` -> ``q_norm`` / ``k_norm``, ``feed_forward.w1 / w3 / w2`` -> ``mlp.gate_proj /
up_proj / down_proj``, ``model.embedding_norm`` (the final norm) -> ``model.norm``; the conv
layer's ``conv.in_proj``, ``conv.conv`` (brought to [hidden, taps]) and ``conv.out_proj`` stay.
"""

from __future__ import annotations

from functools import cache

from kvledger.errors import ConfigError
from kvledger.spec import CONV, FULL, Config, Family, ModelSpec, any_value, is_

_DEFAULTS = {"conv_L_cache": 3, "conv_bias": False, "block_multiple_of": 256,
             "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": True,
             "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "norm_eps": 1e-5}
"""transformers 5.25's ``Lfm2Config`` defaults of the keys a config may omit."""


def mlp_width(ff_dim: int, auto_adjust: bool, multiplier: float | None, multiple_of: int) -> int:
    """The MLP's width as ``Lfm2MLP`` computes it from ``intermediate_size``."""
    if not auto_adjust:
        return ff_dim
    width = int(2 * ff_dim / 3)
    if multiplier is not None:
        width = int(multiplier * width)
        width = multiple_of * ((width + multiple_of - 1) // multiple_of)
    return width


def _prepare(cfg: dict) -> dict:
    out = dict(cfg)
    for old, new in (("block_ff_dim", "intermediate_size"), ("tie_embedding",
                                                            "tie_word_embeddings")):
        if old in out:  # the older spelling wins, as ``Lfm2Config`` pops it over the newer
            out[new] = out[old]
    if "norm_eps" in out:
        out["rms_norm_eps"] = out["norm_eps"]
    return out


def _config_fields(c: Config, n: int) -> dict:
    kernel = c.int("conv_L_cache")
    if kernel < 2:
        raise ConfigError(f"{c.path}: 'conv_L_cache' must be >= 2, got {kernel}")
    auto = bool(c.get("block_auto_adjust_ff_dim"))
    multiple_of = c.int("block_multiple_of") if auto else 1
    if multiple_of < 1:
        raise ConfigError(f"{c.path}: 'block_multiple_of' must be >= 1, got {multiple_of}")
    width = mlp_width(c.int("intermediate_size"), auto, c.get("block_ffn_dim_multiplier"),
                      multiple_of)
    return {"intermediate_size": width, "rms_norm_eps": float(c.get("norm_eps")),
            "qk_norm": True} | _state(c.int("hidden_size"), kernel, bool(c.get("conv_bias")))


def _state(hidden: int, kernel: int, bias: bool) -> dict:
    return {"state_conv_dim": hidden, "state_conv_kernel": kernel, "state_conv_bias": bias}


def _layer_types(c: Config, n: int) -> tuple[str, ...]:
    full = c.get("full_attn_idxs")
    if full is None:
        return (FULL,) * n
    if not isinstance(full, list) or any(not isinstance(i, int) or not 0 <= i < n for i in full):
        raise ConfigError(f"{c.path}: 'full_attn_idxs' must list layer indices below {n}, "
                          f"got {full!r}")
    return tuple(FULL if i in full else CONV for i in range(n))


def _gguf_fields(header, fields: dict) -> dict:
    kv = header.value("attention.head_count_kv")
    kernel = header.value("shortconv.l_cache")
    if kernel is None:
        raise ConfigError(f"GGUF file {header.path} lacks the required key "
                          f"'{header.arch}.shortconv.l_cache'")
    n = fields["num_layers"]
    if not isinstance(kv, list) or len(kv) != n:
        raise ConfigError(f"GGUF file {header.path}: '{header.arch}.attention.head_count_kv' "
                          f"must list {n} per-layer counts (0 on a conv layer)")
    kinds = tuple(FULL if heads else CONV for heads in kv)
    return {"layer_types": kinds, "num_kv_heads": max(kv), "qk_norm": True} | _state(
        fields["hidden_size"], int(kernel), f"blk.{kinds.index(CONV)}.shortconv.conv.bias"
        in header.tensor_names if CONV in kinds else False)


_RENAMES = (("operator_norm.", "input_layernorm."), ("ffn_norm.", "post_attention_layernorm."),
            ("self_attn.out_proj.", "self_attn.o_proj."),
            ("self_attn.q_layernorm.", "self_attn.q_norm."),
            ("self_attn.k_layernorm.", "self_attn.k_norm."),
            ("feed_forward.w1.", "mlp.gate_proj."), ("feed_forward.w3.", "mlp.up_proj."),
            ("feed_forward.w2.", "mlp.down_proj."))


def _weight_names(state: dict, spec: ModelSpec) -> None:
    """LFM2's checkpoint names -> the common ones (module docstring); the convolution's taps
    [hidden, 1, taps] as a GGUF holds them, [hidden, taps]."""
    if "model.embedding_norm.weight" in state:
        state["model.norm.weight"] = state.pop("model.embedding_norm.weight")
    for name in list(state):
        if name.endswith(".conv.conv.weight") and state[name].ndim == 3:
            state[name] = state[name].squeeze(1)
        for old, new in _RENAMES:
            if f".{old}" in name:
                state[name.replace(f".{old}", f".{new}")] = state.pop(name)
                break


def _tensor_shapes(spec: ModelSpec, shapes: dict) -> dict:
    """A conv layer holds the short convolution's tensors instead of self-attention's."""
    h, kernel = spec.hidden_size, spec.state.conv_kernel
    for i, kind in enumerate(spec.layers.types):
        if kind != CONV:
            continue
        p = f"model.layers.{i}."
        shapes = {k: v for k, v in shapes.items() if not k.startswith(p + "self_attn.")}
        shapes |= {p + "conv.in_proj.weight": (3 * h, h), p + "conv.conv.weight": (h, kernel),
                   p + "conv.out_proj.weight": (h, h)}
        if spec.state.conv_bias:
            shapes |= {p + "conv.in_proj.bias": (3 * h,), p + "conv.conv.bias": (h,),
                       p + "conv.out_proj.bias": (h,)}
    return shapes


@cache
def _model() -> type:
    import torch

    from kvledger.model.layers.decoder import Decoder
    from kvledger.model.layers.short_conv import ShortConv

    class Lfm2Decoder(Decoder):
        """The decoder with LFM2's short convolution on its ``conv`` layers."""

        def state_mixer(self, w: dict[str, torch.Tensor], prefix: str, linear, i: int):
            p = prefix + "conv."
            taps = w.pop(p + "conv.weight")
            bias = w.pop(p + "conv.bias", None)
            return ShortConv(linear([p + "in_proj"], "qkv"), linear([p + "out_proj"], "o"),
                             taps.reshape(taps.shape[0], -1).to(self.dtype),
                             None if bias is None else bias.to(self.dtype))

    return Lfm2Decoder


FAMILY = Family(
    name="lfm2",
    model_types=("lfm2",),
    runs={"layer_types": lambda kinds: set(kinds) <= {FULL, CONV}, "qk_norm": is_(True),
          "state_conv_dim": any_value, "state_conv_kernel": any_value,
          "state_conv_bias": any_value},
    config_prepare=_prepare,
    config_defaults={"lfm2": _DEFAULTS},
    config_fields=_config_fields,
    layer_types=_layer_types,
    gguf_archs={"lfm2": "lfm2"},
    gguf_fields=_gguf_fields,
    gguf_tensors={"shortconv.in_proj": "conv.in_proj", "shortconv.conv": "conv.conv",
                  "shortconv.out_proj": "conv.out_proj"},
    weight_names=_weight_names,
    tensor_shapes=_tensor_shapes,
    model=_model,
)
