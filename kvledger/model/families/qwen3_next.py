"""Qwen3-Next: read for `kvledger plan` only. A full-attention layer every
``full_attention_interval`` (with an output gate on q_proj and per-head q/k norms), Gated
DeltaNet linear attention elsewhere (a fixed per-sequence state: the recurrent matrix of
value_heads x key_head_dim x value_head_dim plus the convolution's last ``kernel - 1`` inputs),
routed experts and a gated shared expert (:func:`kvledger.model.families.moe.qwen_moe_fields`).
The engine refuses it."""

from __future__ import annotations

from kvledger.errors import ConfigError
from kvledger.model.families.moe import qwen_moe_fields
from kvledger.spec import LINEAR, Config, Family, every_nth_full


def gated_deltanet_fields(kh: int, vh: int, kd: int, vd: int, kernel: int, where) -> dict:
    """The ``linear`` and ``state`` fields of gated DeltaNet layers of ``kh`` key and ``vh``
    value heads of ``kd`` / ``vd`` channels, a convolution of ``kernel`` taps over q, k and v;
    ``where`` names the source in errors.

    Raises:
        ConfigError: value heads not a multiple of the key heads, a size below 1, or a kernel
            below 2, naming the field.
    """
    sizes = {"linear_num_key_heads": kh, "linear_num_value_heads": vh,
             "linear_key_head_dim": kd, "linear_value_head_dim": vd}
    for name, value in sizes.items():
        if value < 1:
            raise ConfigError(f"{where}: {name!r} must be >= 1, got {value}")
    if vh % kh:
        raise ConfigError(f"{where}: 'linear_num_value_heads' ({vh}) must be a multiple of "
                          f"'linear_num_key_heads' ({kh})")
    if kernel < 2:
        raise ConfigError(f"{where}: 'linear_conv_kernel_dim' must be >= 2, got {kernel}")
    return sizes | {
        "linear_conv_kernel_dim": kernel,
        "state_conv_dim": 2 * kh * kd + vh * vd,
        "state_conv_kernel": kernel,
        "state_recurrent_shape": (vh, kd, vd),
    }


def _linear_attention_fields(c: Config) -> dict:
    return gated_deltanet_fields(
        c.int("linear_num_key_heads"), c.int("linear_num_value_heads"),
        c.int("linear_key_head_dim"), c.int("linear_value_head_dim"),
        c.int("linear_conv_kernel_dim"), c.path)


def _config_fields(c: Config, n: int) -> dict:
    return qwen_moe_fields(c, n) | _linear_attention_fields(c) | {
        "qk_norm": True, "attn_output_gate": True}


def _layer_types(c: Config, n: int) -> tuple[str, ...]:
    return every_nth_full(int(c.req("full_attention_interval")), n, other=LINEAR)


FAMILY = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    what="Gated DeltaNet linear attention and gated shared experts",
    config_fields=_config_fields,
    layer_types=_layer_types,
)
