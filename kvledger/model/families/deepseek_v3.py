"""DeepSeek-V3 and Kimi K2 (arXiv:2412.19437): read for `kvledger plan` only. MLA as
DeepSeek-V2's (:func:`kvledger.model.families.deepseek.mla_fields`) with sigmoid routing and a
per-expert score correction (``topk_method: noaux_tc``, ``router_bias``) and fp8 weights; the
engine refuses it."""

from __future__ import annotations

from kvledger.model.families.deepseek import mla_fields
from kvledger.spec import Family

FAMILY = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3", "kimi_k2"),
    what="multi-head latent attention and routed experts",
    config_fields=mla_fields,
)
