"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and of k before RoPE
(Qwen team, "Qwen3 Technical Report", arXiv:2505.09388 §2; transformers' ``Qwen3Attention``),
no q/k/v bias. A config that turns on ``use_sliding_window`` slides from ``max_window_layers``
on, as transformers places it (``kvledger.spec``)."""

from __future__ import annotations

from kvledger.model.llama import LlamaModel


class Qwen3Model(LlamaModel):
    """Qwen3: :class:`LlamaModel` whose layers carry ``q_norm`` / ``k_norm`` [head_dim]."""

    FAMILY = "qwen3"
