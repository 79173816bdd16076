"""Phi-3 / Phi-4-mini (``model_type: phi3``): the Llama decoder with a uniform sliding window,
a partial rotary factor (Phi-4-mini turns 0.75 of each head) and LongRoPE (Microsoft, "Phi-3
Technical Report", arXiv:2404.14219; transformers' ``Phi3Model``).

The checkpoint's fused ``qkv_proj`` and ``gate_up_proj`` (gate rows first, as ``Phi3MLP``
chunks them) are split into the Llama names when loaded (``model/weights/names.py``) and fused
again here like any Llama layer. LongRoPE's short or long factors are chosen once, from the
max model length (:mod:`kvledger.model.rope`).
"""

from __future__ import annotations

from kvledger.model.llama import LlamaModel


class Phi3Model(LlamaModel):
    """Phi-3: :class:`LlamaModel` with RoPE on ``spec.rotary_dim`` dimensions, LongRoPE."""

    FAMILY = "phi3"
