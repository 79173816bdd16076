"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and of k before RoPE
(Qwen team, "Qwen3 Technical Report", arXiv:2505.09388 §2; transformers' ``Qwen3Attention``),
no q/k/v bias. A config that turns on ``use_sliding_window`` slides from ``max_window_layers``
on, as transformers places it."""

from __future__ import annotations

from kvledger.model.layers import plain_decoder
from kvledger.spec import Config, Family, any_value, full_and_sliding, use_sliding_window


def _config_fields(c: Config, n: int) -> dict:
    return {"qk_norm": True}


FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    runs={"layer_types": full_and_sliding, "sliding_window": any_value, "qk_norm": any_value},
    config_fields=_config_fields,
    layer_types=use_sliding_window,
    gguf_archs={"qwen3": "qwen3"},
    model=plain_decoder,
)
