"""Mixtral and Qwen3-MoE: the Llama decoder (Qwen3-MoE with Qwen3's per-head q/k RMSNorm) whose
MLP is, on its MoE layers, routed experts (:mod:`.experts`; Mixtral, arXiv:2401.04088 §2;
Qwen team, "Qwen3 Technical Report", arXiv:2505.09388 §2; transformers' ``MixtralModel`` /
``Qwen3MoeModel``).

- Routing: softmax over all experts, the top ``num_experts_per_tok``; Mixtral renormalises
  them (the softmax over the chosen k), Qwen3-MoE when its config's ``norm_topk_prob`` says so.
- Qwen3-MoE's MoE layers are those with ``(i + 1) % decoder_sparse_step == 0`` not in
  ``mlp_only_layers``; the others keep a dense MLP of ``intermediate_size``
  (``ModelSpec.experts.mlp_only_layers``, ``ModelSpec.is_moe_layer``). Mixtral's layers are all MoE.
- No shared expert (Qwen2-MoE's): refused. gpt-oss (router and expert biases, its clamped
  SwiGLU) is :mod:`.gpt_oss`, on this class.

Mixtral checkpoints name their experts ``block_sparse_moe.experts.{e}.w1/w3/w2``; the loader
brings them to Qwen-MoE's names (``model/weights/names.py``), as it splits a GGUF's stacked
``ffn_*_exps``.
"""

from __future__ import annotations

import torch

from kvledger.model.experts import Experts
from kvledger.model.linear import Linear
from kvledger.model.llama import LlamaModel, _fused_linear


class MoEModel(LlamaModel):
    """Mixtral / Qwen3-MoE: :class:`LlamaModel` whose MoE layers hold ``experts``."""

    FAMILY = "moe"

    def _mlp_layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        """A dense layer's ``gate_up`` / ``down``, or an MoE layer's :class:`Experts` with each
        expert in the ``gate_up`` / ``down`` classes' formats."""
        if not self.spec.is_moe_layer(i):
            return super()._mlp_layer(w, i, release)
        mlp, formats, dtype = f"model.layers.{i}.mlp.", self.formats, self.dtype
        router = Linear(w.pop(mlp + "gate.weight"), w.pop(mlp + "gate.bias", None))
        gate_up, down = [], []
        for e in range(self.spec.experts.count):
            stem = f"{mlp}experts.{e}."
            gate_up.append(_fused_linear(w, [stem + "gate_proj", stem + "up_proj"],
                                         formats.get("gate_up", "dense"), release, dtype))
            down.append(_fused_linear(w, [stem + "down_proj"], formats.get("down", "dense"),
                                      release, dtype))
        return {"experts": Experts(router, gate_up, down, self.spec.experts.per_token,
                                   self.spec.experts.norm_topk_prob, self.expert_act)}

    def expert_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' activation ``[T, 2f] -> [T, f]`` of gate then up columns: SwiGLU
        (``self.act``, set after the layers are built)."""
        return self.act(gate_up)

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        if "experts" in layer:
            return layer["experts"](x)
        return super()._mlp(layer, x)

    @staticmethod
    def class_linears(layer: dict, shape_class: str) -> list[Linear]:
        if shape_class not in layer and "experts" in layer:
            return layer["experts"].linears(shape_class)
        return LlamaModel.class_linears(layer, shape_class)

    @property
    def experts(self) -> list[Experts]:
        """The MoE layers' experts, in layer order."""
        return [layer["experts"] for layer in self.layers if "experts" in layer]

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one batch-1 decode step reads: every layer's attention Linears and
        dense MLPs, the LM head, and per MoE layer its router and ``num_experts_per_tok``
        experts (a larger batch reads the distinct experts its tokens chose:
        :attr:`Experts.bytes_read`)."""
        k = self.spec.experts.per_token
        dense = [layer[cls] for layer in self.layers for cls in ("qkv", "o", "gate_up", "down")
                 if cls in layer]
        routed = sum(ex.router.nbytes + k * ex.expert_bytes for ex in self.experts)
        return sum(lin.nbytes for lin in dense) + self.lm_head.nbytes + routed

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight held (as :attr:`LlamaModel.weight_bytes`, every expert)."""
        linears = [self.lm_head] + ([] if self.embed is self.lm_head else [self.embed])
        vectors = [self.final_norm]
        for layer in self.layers:
            linears += [lin for cls in ("qkv", "o", "gate_up", "down")
                        for lin in self.class_linears(layer, cls)]
            linears += [layer["experts"].router] if "experts" in layer else []
            vectors += [t for key, t in layer.items() if key.endswith("norm")]
        vectors += [lin.bias for lin in linears if lin.bias is not None]
        return sum(lin.nbytes for lin in linears) + sum(t.nbytes for t in vectors)

    @property
    def weight_formats(self) -> dict[str, str]:
        """Format held per shape class; ``gate_up`` / ``down`` are the experts' (each expert
        holds one; a dense MLP layer of Qwen3-MoE takes the same class's format)."""
        layer = next((layer for layer in self.layers if "experts" in layer), self.layers[0])
        held = {cls: self.class_linears(layer, cls)[0].format
                for cls in ("qkv", "o", "gate_up", "down")}
        return {**held, "lm_head": self.lm_head.format}
