"""Qwen2-MoE / Qwen1.5-MoE: read for `kvledger plan` only. The Qwen2 decoder (q/k/v biases)
with routed experts (:func:`kvledger.model.families.moe.qwen_moe_fields`) and a shared expert
behind a sigmoid gate, which the engine does not compute."""

from __future__ import annotations

from kvledger.model.families.moe import qwen_moe_fields
from kvledger.spec import Config, Family, use_sliding_window


def _config_fields(c: Config, n: int) -> dict:
    return qwen_moe_fields(c, n)


FAMILY = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    what="routed experts and a gated shared expert",
    config_fields=_config_fields,
    layer_types=use_sliding_window,
)
