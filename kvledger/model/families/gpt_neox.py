"""GPT-NeoX (Black et al., arXiv:2204.06745; Pythia, RedPajama-INCITE): read for `kvledger
plan` only. LayerNorm (weight and bias), attention and MLP in parallel off one residual, an
ungated GELU MLP, biases on every projection (``attention_bias``, default true). The engine
refuses it."""

from __future__ import annotations

from kvledger.spec import Config, Family


def _config_fields(c: Config, n: int) -> dict:
    return {"mlp_gated": False, "mlp_bias": True, "norm_bias": True, "o_bias": True,
            "qkv_bias": bool(c.get("attention_bias", True))}


FAMILY = Family(
    name="gpt_neox",
    model_types=("gpt_neox",),
    what="a LayerNorm decoder with parallel attention and MLP",
    config_defaults={"gpt_neox": {"attention_bias": True, "layer_norm_eps": 1e-5}},
    config_fields=_config_fields,
)
