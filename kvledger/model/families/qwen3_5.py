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

GGUF (llama.cpp's converter, ``qwen35`` / ``qwen35moe``): ``ssm.conv_kernel``, ``ssm.state_size``
(key_head_dim), ``ssm.group_count`` (key heads), ``ssm.time_step_rank`` (value heads),
``ssm.inner_size`` (value heads x value_head_dim), ``full_attention_interval``.
"""

from __future__ import annotations

import logging
from functools import cache

from kvledger.errors import ConfigError, UnsupportedModelError
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
    n = fields["num_layers"]
    recurrent = header.value("attention.recurrent_layers")
    if isinstance(recurrent, list) and len(recurrent) == n:
        kinds = tuple(LINEAR if r else FULL for r in recurrent)
    else:
        kinds = every_nth_full(req("full_attention_interval"), n, other=LINEAR)
    out = gated_deltanet_fields(kh, vh, kd, inner // vh, req("ssm.conv_kernel"), header.path)
    out |= {"layer_types": kinds, "qk_norm": True, "attn_output_gate": True}
    if fields.get("num_experts"):
        out |= {"mlp_only_layers": (), "shared_expert_gate": True}
        shared = header.value("expert_shared_feed_forward_length")
        if shared:
            out |= {"num_shared_experts": 1, "shared_expert_intermediate_size": int(shared)}
    return out


def _weight_names(state: dict, spec: ModelSpec) -> None:
    """A ``qwen3_5`` folder's text model, ``model.language_model.*`` -> ``model.*``; its vision
    tower ``model.visual.*`` dropped; the MoE model's shared expert and stacked experts renamed
    (module docstring).

    Raises:
        UnsupportedModelError: for a GGUF's weights: llama.cpp's converter reorders the value
            heads (grouped -> tiled), stores ``-exp(A_log)`` and ``1 + w`` norms, which the
            engine does not read back yet (`kvledger plan` sizes the file).
    """
    arch = spec.extra.get("gguf_architecture")
    if arch:
        raise UnsupportedModelError(
            f"{spec.source}: the engine cannot run a '{arch}' GGUF's weights yet (llama.cpp's "
            "converter reorders the gated DeltaNet's value heads); run the Hugging Face folder, "
            "`kvledger plan` still sizes the file")
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
    weight_names=_weight_names,
    tensor_shapes=_tensor_shapes,
    norm_offset=1.0,
    model=_model,
)
