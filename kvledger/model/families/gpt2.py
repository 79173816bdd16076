"""GPT-2 (Radford et al., 2019): read for `kvledger plan` only. LayerNorm (weight and bias),
a learned absolute position table of ``n_positions`` rows, an ungated GELU MLP of
``n_inner`` (absent: 4 x hidden), biases everywhere, tied embeddings; its config spells the
sizes ``n_layer`` / ``n_embd`` / ``n_head`` / ``n_positions`` / ``n_inner`` /
``layer_norm_epsilon``. The engine refuses it."""

from __future__ import annotations

from kvledger.spec import Config, Family

_KEYS = {"n_layer": "num_hidden_layers", "n_embd": "hidden_size",
         "n_head": "num_attention_heads", "n_positions": "max_position_embeddings",
         "n_inner": "intermediate_size", "layer_norm_epsilon": "rms_norm_eps"}


def _prepare(cfg: dict) -> dict:
    cfg = {_KEYS.get(k, k): v for k, v in cfg.items()}
    if cfg.get("intermediate_size") is None and "hidden_size" in cfg:
        cfg["intermediate_size"] = 4 * cfg["hidden_size"]
    return cfg


def _config_fields(c: Config, n: int) -> dict:
    return {"mlp_gated": False, "mlp_bias": True, "norm_bias": True, "o_bias": True,
            "qkv_bias": bool(c.get("attention_bias", True)),
            "position_embeddings": c.int("max_position_embeddings")}


FAMILY = Family(
    name="gpt2",
    model_types=("gpt2",),
    what="a LayerNorm, learned-position decoder",
    config_prepare=_prepare,
    config_defaults={"gpt2": {"tie_word_embeddings": True}},
    config_fields=_config_fields,
)
