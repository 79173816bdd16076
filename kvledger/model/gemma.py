"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's changes (Gemma Team, "Gemma 2",
arXiv:2408.00118 §2; "Gemma 3 Technical Report", arXiv:2503.19786 §2; transformers'
``Gemma2Model`` / ``Gemma3TextModel``):

- RMSNorm as ``x / rms(x) * (1 + w)``: every norm weight is held as ``1 + w``;
- norms before and after attention and before and after the MLP (sandwich);
- GeGLU with tanh-approximated GELU (``gelu_pytorch_tanh``);
- the embedding scaled by sqrt(hidden), that factor rounded to the model's dtype first;
- scores scaled by ``query_pre_attn_scalar ** -0.5``;
- Gemma 2: attention scores and final logits soft-capped, ``c tanh(x / c)``;
- interleaved sliding and global layers (``layer_types``; older configs
  ``sliding_window_pattern``);
- Gemma 3: per-head q and k norms, the sliding layers' own RoPE base (``rope_local_base_freq``)
  and the global layers' RoPE scaling (linear, factor 8 on 4B and up).

A multimodal Gemma 3 folder (4B and up) loads its text model only (``model/weights/names.py``).
"""

from __future__ import annotations

import torch

from kvledger.model.llama import LlamaModel


class GemmaModel(LlamaModel):
    """Gemma 2 / Gemma 3 text decoder (see the module docstring)."""

    FAMILY = "gemma"
    NORM_OFFSET = 1.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.act = self.ops.gelu_tanh_mul
        self.normalizer = torch.tensor(self.spec.hidden_size ** 0.5, dtype=self.dtype)

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows times sqrt(hidden) in the model's dtype."""
        return super().embed_rows(input_ids) * self.normalizer

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32, soft-capped when the spec says so."""
        logits = super().compute_logits(hidden)
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
