"""Qwen3.5 (``qwen3_5`` with a ``text_config``, the text-only ``qwen3_5_text``) and Qwen3.5-MoE
(``qwen3_5_moe``, ``qwen3_5_moe_text``): both run in the engine.

Three gated DeltaNet layers (Yang et al., arXiv:2412.06464: a causal convolution over q, k and
v, L2-normed q / k, the delta rule with its decay and write gates) beside each full-attention
layer (``layer_types``, else a full layer every ``full_attention_interval``, 4), which gates
its output from q_proj, norms q and k per head and turns ``partial_rotary_factor`` (0.25) of
each head. Per sequence each DeltaNet layer keeps a recurrent matrix of value_heads x
key_head_dim x value_head_dim and the convolution's last ``kernel - 1`` inputs
(:func:`~kvledger.model.families.qwen3_next.gated_deltanet_fields`). A multimodal wrapper's
vision tower is ignored (one log line).

The forward: the decoder with every RMSNorm of the residual stream and of q / k in the
``(1 + w)`` form (``Qwen3_5RMSNorm``: input, post-attention, final, q_norm, k_norm), the gated
full attention (:class:`~kvledger.model.layers.attention.SelfAttention` with its output gate
and partial rotary), and on each ``linear_attention`` layer the gated DeltaNet
(:class:`~kvledger.model.layers.gated_deltanet.GatedDeltaNet`), whose gated norm inside
(``Qwen3_5RMSNormGated``) is the plain ``w`` form. The MoE model's MLP on every layer
(transformers' ``Qwen3_5MoeSparseMoeBlock``): a softmax router whose top ``num_experts_per_tok``
weights are always renormalised over the k (the config has no ``norm_topk_prob``), experts of
``moe_intermediate_size``, and one shared expert of ``shared_expert_intermediate_size`` times
``sigmoid(shared_expert_gate x)`` (:class:`~kvledger.model.layers.mlp.SigmoidGatedMLP`).
Checkpoint names: ``mlp.shared_expert.*`` -> ``mlp.shared_experts.*``; the experts per expert
(as transformers saves them) or stacked (``mlp.experts.gate_up_proj`` [experts, 2f, hidden],
``mlp.experts.down_proj`` [experts, hidden, f]).

GGUF (llama.cpp's converter, ``qwen35`` / ``qwen35moe``, ``conversion/qwen.py``): ``ssm.conv_kernel``,
``ssm.state_size`` (key_head_dim), ``ssm.group_count`` (key heads), ``ssm.time_step_rank`` (value
heads), ``ssm.inner_size`` (value heads x value_head_dim), ``attention.recurrent_layers`` (else
``full_attention_interval``), ``rope.dimension_count`` (the rotary share), and
``nextn_predict_layers`` multi-token-prediction blocks after the decoder's (not read). Its
tensors: the DeltaNet's ``attn_qkv``, ``attn_gate`` (z), ``ssm_beta`` / ``ssm_alpha``,
``ssm_conv1d``, ``ssm_a``, ``ssm_dt.bias``, ``ssm_norm``, ``ssm_out``; ``post_attention_norm``;
the shared expert as ``ffn_*_shexp`` and its gate ``ffn_gate_inp_shexp``; every norm but the
DeltaNet's stored as ``1 + w``, the value heads reordered: :func:`_gguf_weights` undoes it.
"""

from __future__ import annotations

import logging
from functools import cache

from kvledger.errors import ConfigError
from kvledger.model.families.moe import qwen_moe_fields
from kvledger.model.families.qwen3_next import gated_deltanet_fields
from kvledger.spec import FULL, LINEAR, Config, Family, ModelSpec, any_value, every_nth_full, is_

log = logging.getLogger(__name__)

_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
             "linear_value_head_dim": 128, "linear_num_key_heads": 16,
             "linear_num_value_heads": 32, "partial_rotary_factor": 0.25, "head_dim": 256,
             "full_attention_interval": 4, "rms_norm_eps": 1e-6}
"""transformers 5.25's ``Qwen3_5TextConfig`` defaults of the keys a config may omit."""


def _prepare(cfg: dict) -> dict:
    if cfg.get("vision_config"):
        log.info("%s: the vision tower is ignored (text decoder only)", cfg.get("model_type"))
    return cfg


def _config_fields(c: Config, n: int) -> dict:
    fields = gated_deltanet_fields(
        c.int("linear_num_key_heads"), c.int("linear_num_value_heads"),
        c.int("linear_key_head_dim"), c.int("linear_value_head_dim"),
        c.int("linear_conv_kernel_dim"), c.path)
    fields |= {"qk_norm": True, "attn_output_gate": True}
    if c.model_type.startswith("qwen3_5_moe"):
        fields |= qwen_moe_fields(c, n) | {"shared_expert_gate": True, "norm_topk_prob": True}
    return fields


def _layer_types(c: Config, n: int) -> tuple[str, ...]:
    return every_nth_full(int(c.req("full_attention_interval")), n, other=LINEAR)


def _gguf_fields(header, fields: dict) -> dict:
    def req(key: str) -> int:
        value = header.value(key)
        if value is None:
            raise ConfigError(f"GGUF file {header.path} lacks the required key "
                              f"'{header.arch}.{key}'")
        return int(value)

    kh, vh, kd = req("ssm.group_count"), req("ssm.time_step_rank"), req("ssm.state_size")
    inner = req("ssm.inner_size")
    if inner % vh:
        raise ConfigError(f"GGUF file {header.path}: '{header.arch}.ssm.inner_size' ({inner}) "
                          f"is not a multiple of the value heads ({vh})")
    blocks = fields["num_layers"]
    n = blocks - int(header.value("nextn_predict_layers") or 0)  # the MTP layers come last
    recurrent = header.value("attention.recurrent_layers")
    if isinstance(recurrent, list) and len(recurrent) == blocks:
        kinds = tuple(LINEAR if r else FULL for r in recurrent[:n])
    else:
        kinds = every_nth_full(req("full_attention_interval"), n, other=LINEAR)
    out = gated_deltanet_fields(kh, vh, kd, inner // vh, req("ssm.conv_kernel"), header.path)
    out |= {"num_layers": n, "layer_types": kinds, "qk_norm": True, "attn_output_gate": True}
    if fields.get("num_experts"):
        out |= {"mlp_only_layers": (), "shared_expert_gate": True}
        shared = header.value("expert_shared_feed_forward_length")
        if shared:
            out |= {"num_shared_experts": 1, "shared_expert_intermediate_size": int(shared)}
    return out


def _weight_names(state: dict, spec: ModelSpec) -> None:
    """A ``qwen3_5`` folder's text model, ``model.language_model.*`` -> ``model.*``; its vision
    tower ``model.visual.*`` dropped; the MoE model's shared expert and stacked experts renamed
    (module docstring); a GGUF's tensors brought back to the checkpoint's form
    (:func:`_gguf_weights`)."""
    if spec.extra.get("gguf_architecture"):
        _gguf_weights(state, spec)
        return
    for name in list(state):
        if name.startswith("model.visual."):
            del state[name]
            continue
        new = name.replace("model.language_model.", "model.", 1)
        new = new.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        if new.endswith(".mlp.experts.gate_up_proj"):
            gate, up = state.pop(name).chunk(2, dim=1)
            state[new.replace("gate_up_proj", "gate_proj.weight")] = gate
            state[new.replace("gate_up_proj", "up_proj.weight")] = up
        elif new.endswith(".mlp.experts.down_proj"):
            state[new + ".weight"] = state.pop(name)
        elif new != name:
            state[new] = state.pop(name)


def _untile(x, dim: int, kh: int, width: int):
    """``x`` with its value-head blocks along ``dim`` (each ``width`` wide) from llama.cpp's tiled
    order (value head j of key head g at ``j * kh + g``) back to the checkpoint's grouped one
    (at ``g * vh / kh + j``): the inverse of the converter's ``_reorder_v_heads``."""
    shape = list(x.shape)
    r = shape[dim] // (kh * width)
    tiled = x.reshape(*shape[:dim], r, kh, width, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape).contiguous()


def _gguf_weights(state: dict, spec: ModelSpec) -> None:
    """A ``qwen35`` / ``qwen35moe`` GGUF's tensors as the checkpoint holds them (llama.cpp's
    ``_LinearAttentionVReorderBase`` and ``Qwen3NextModel`` undone): the value heads back in
    grouped order in ``in_proj_qkv``'s v rows, ``in_proj_z``, ``in_proj_a`` / ``_b``,
    ``A_log``, ``dt_bias``, the conv's v channels and ``out_proj``'s columns; ``A_log`` from
    the stored ``-exp(A_log)``; the conv taps [channels, 1, taps]; the gated norm, which the
    converter left as ``w``, given back the 1 the loader took from every norm
    (``gguf_norm_plus_one``); a packed 4-bit copy of a reordered matrix dropped (the
    dequantized one is used); the multi-token-prediction layers past ``num_layers`` dropped."""
    import torch

    lin = spec.linear
    kh, vd, qk = lin.num_key_heads, lin.value_head_dim, 2 * lin.num_key_heads * lin.key_head_dim
    for name in list(state):
        if name.startswith("mtp.") or (name.startswith("model.layers.") and
                                       int(name.split(".")[2]) >= spec.num_layers):
            del state[name]
            continue
        stem, found, rest = name.partition(".linear_attn.")
        if not found or rest.endswith((".q4_codes", ".q4_scale", ".q4_zero")):
            continue
        x = state[name]
        if rest in ("in_proj_qkv.weight", "conv1d.weight"):
            x = torch.cat([x[:qk], _untile(x[qk:], 0, kh, vd)])
            x = x[:, None, :] if rest == "conv1d.weight" and x.ndim == 2 else x
        elif rest == "in_proj_z.weight":
            x = _untile(x, 0, kh, vd)
        elif rest in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt.bias"):
            x = _untile(x, 0, kh, 1)
        elif rest == "out_proj.weight":
            x = _untile(x, 1, kh, vd)
        elif rest == "norm.weight":
            x = (x.float() + 1.0).to(x.dtype)
        if rest == "A_log":
            x = (-x.double()).log().to(state[name].dtype)
        if rest == "dt.bias":
            del state[name]
            name = f"{stem}.linear_attn.dt_bias"
        state[name] = x
        for part in (".q4_codes", ".q4_scale", ".q4_zero"):
            state.pop(name.removesuffix(".weight") + part, None)


def _tensor_shapes(spec: ModelSpec, shapes: dict) -> dict:
    """A linear layer holds the gated DeltaNet's tensors instead of self-attention's; a full
    layer's q_proj holds each head's gate rows beside its q rows."""
    h, lin, conv = spec.hidden_size, spec.linear, spec.state.conv_dim
    q = spec.num_attention_heads * spec.head_dim
    vh, value = lin.num_value_heads, lin.num_value_heads * lin.value_head_dim
    for i, kind in enumerate(spec.layers.types):
        p = f"model.layers.{i}."
        if kind != LINEAR:
            shapes[p + "self_attn.q_proj.weight"] = (2 * q, h)
            continue
        shapes = {k: v for k, v in shapes.items() if not k.startswith(p + "self_attn.")}
        a = p + "linear_attn."
        shapes |= {a + "in_proj_qkv.weight": (conv, h), a + "in_proj_z.weight": (value, h),
                   a + "in_proj_b.weight": (vh, h), a + "in_proj_a.weight": (vh, h),
                   a + "conv1d.weight": (conv, 1, lin.conv_kernel_dim), a + "A_log": (vh,),
                   a + "dt_bias": (vh,), a + "norm.weight": (lin.value_head_dim,),
                   a + "out_proj.weight": (h, value)}
    return shapes


@cache
def _model() -> type:
    import torch

    from kvledger.model.layers.decoder import Decoder
    from kvledger.model.layers.gated_deltanet import DeltaNetShape, GatedDeltaNet

    class Qwen3_5Decoder(Decoder):
        """The decoder with ``(1 + w)`` norms and gated DeltaNet on its linear layers."""

        NORM_OFFSET = FAMILY.norm_offset

        def state_mixer(self, w: dict[str, torch.Tensor], prefix: str, linear, i: int):
            spec, lin = self.spec, self.spec.linear
            shape = DeltaNetShape(spec.hidden_size, lin.num_key_heads, lin.num_value_heads,
                                  lin.key_head_dim, lin.value_head_dim, lin.conv_kernel_dim,
                                  spec.norm.eps)
            return GatedDeltaNet.from_weights(shape, w, prefix, linear, self.kernels)

    return Qwen3_5Decoder


_RUNS = {"layer_types": lambda kinds: set(kinds) <= {FULL, LINEAR}, "qk_norm": is_(True),
         "attn_output_gate": any_value, "partial_rotary_factor": any_value} | {
    name: any_value for name in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim", "state_conv_dim",
        "state_conv_kernel", "state_recurrent_shape", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size", "num_shared_experts", "shared_expert_intermediate_size",
        "shared_expert_gate", "norm_topk_prob", "mlp_only_layers")}
"""What the forward computes: the dense model, and the MoE one's routed experts (renormalised
top-k; dense layers among them too, though Qwen3.5-MoE has none) beside a sigmoid-gated shared
expert."""


FAMILY = Family(
    name="qwen3_5",
    model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
    what="gated DeltaNet linear attention beside gated full attention",
    runs=_RUNS,
    config_prepare=_prepare,
    config_defaults={t: _DEFAULTS for t in ("qwen3_5", "qwen3_5_text")}
    | {t: _DEFAULTS | {"intermediate_size": 0, "moe_intermediate_size": 512,
                       "shared_expert_intermediate_size": 512,
                       "num_experts_per_tok": 8, "num_experts": 256}
       for t in ("qwen3_5_moe", "qwen3_5_moe_text")},
    config_fields=_config_fields,
    layer_types=_layer_types,
    gguf_archs={"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"},
    gguf_fields=_gguf_fields,
    gguf_tensors={"attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                  "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a",
                  "ssm_conv1d": "linear_attn.conv1d", "ssm_a": "linear_attn.A_log",
                  "ssm_dt": "linear_attn.dt", "ssm_norm": "linear_attn.norm",
                  "ssm_out": "linear_attn.out_proj", "post_attention_norm": "post_attention_layernorm",
                  "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                  "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                  "ffn_up_shexp": "mlp.shared_experts.up_proj",
                  "ffn_down_shexp": "mlp.shared_experts.down_proj"}
    | {f"nextn.{part}": f"mtp.{part}" for part in (
        "eh_proj", "embed_tokens", "enorm", "hnorm", "shared_head_head", "shared_head_norm")},
    gguf_norm_plus_one=True,
    weight_names=_weight_names,
    tensor_shapes=_tensor_shapes,
    norm_offset=1.0,
    model=_model,
)
