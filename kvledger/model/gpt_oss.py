"""gpt-oss: the Llama decoder with routed experts (:class:`.moe.MoEModel`) and OpenAI's changes
(OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025; transformers' ``GptOssModel``):

- biases on the q, k, v and o projections;
- learned sink logits, one per query head, in every attention softmax's denominator (no KV:
  ``engine/attention/layer.py``'s ``sinks``), handed to the attention backend per layer;
- alternating sliding (window 128) and full layers (``layer_types``; the hybrid pool);
- YaRN RoPE (``model/rope.py``);
- the router: a Linear with bias, the top-k of its logits, softmaxed over those k (the same
  weights as the softmax over all experts renormalised over the top k: ``norm_topk_prob``);
- experts with biases and the clamped SwiGLU ``(clamp(up, -l, l) + 1) g sigmoid(a g)``,
  ``g = min(gate, l)``, l = ``swiglu_limit`` (7), a = ``swiglu_alpha`` (1.702)
  (:meth:`kvledger.model.ops.TorchOps.clamped_swiglu`); the checkpoint's alternate gate / up
  columns are split into gate rows then up rows at load (``model/weights/names.py``), MXFP4
  experts dequantized there (``model/weights/mxfp4.py``).
"""

from __future__ import annotations

import dataclasses

import torch

from kvledger.engine.attention.layer import layers_of
from kvledger.model.moe import MoEModel


class GptOssModel(MoEModel):
    """gpt-oss (see the module docstring)."""

    FAMILY = "gpt_oss"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.attention.set_layers([dataclasses.replace(how, sinks=layer["sinks"])
                                   for how, layer in zip(layers_of(self.spec), self.layers)])

    def _layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        """:meth:`MoEModel._layer` and the layer's sink logits [heads] in fp32."""
        layer = super()._layer(w, i, release)
        layer["sinks"] = w.pop(f"model.layers.{i}.self_attn.sinks").float()
        return layer

    def expert_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of the experts (module docstring)."""
        experts = self.spec.experts
        return self.ops.clamped_swiglu(gate_up, experts.swiglu_alpha, experts.swiglu_limit)
