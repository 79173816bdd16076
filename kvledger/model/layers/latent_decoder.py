"""The decoder with multi-head latent attention (:mod:`.latent_attention`) on every layer and
DeepSeekMoE's MLP (DeepSeek-V2 and V2-Lite, arXiv:2405.04434; transformers'
``DeepseekV2ForCausalLM``): a dense SwiGLU MLP on the first ``first_k_dense_replace`` layers,
then group-routed experts (:class:`.experts.GroupRoutedExperts`, never renormalised, times
``routed_scaling_factor``) plus the shared experts, one SwiGLU MLP of ``num_shared_experts x
moe_intermediate_size`` added for every token. The attention backend's score scale is
multiplied by YaRN's softmax factor (:func:`.rotary.yarn_softmax_factor`).
"""

from __future__ import annotations

import dataclasses

import torch

from kvledger.model.layers.decoder import Decoder
from kvledger.model.layers.experts import GroupRoutedExperts
from kvledger.model.layers.latent_attention import LatentAttention
from kvledger.model.layers.rotary import InterleavedRope, yarn_softmax_factor
from kvledger.model.linear import Linear


class LatentDecoder(Decoder):
    """:class:`Decoder` whose layers hold ``mla`` (:class:`LatentAttention`) and, on MoE
    layers, ``experts`` and the shared experts' ``shared_gate_up`` / ``shared_down``."""

    def __init__(self, spec, weights, dtype, *, device, attention, formats=None) -> None:
        super().__init__(spec, weights, dtype, device=device, attention=attention,
                         formats=formats)
        factor = yarn_softmax_factor(spec.rope_scaling)
        attention.set_layers([dataclasses.replace(how, scale=how.scale * factor)
                              for how in attention.layers])

    def _ropes(self) -> list[InterleavedRope]:
        return [InterleavedRope(self.spec)] * self.spec.num_layers

    def _layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        prefix = f"model.layers.{i}."

        def linear(stems: list[str], shape_class: str) -> Linear:
            return self._linear(w, stems, shape_class, release)

        layer = {"mla": LatentAttention(self.spec, w, prefix, linear, self.dtype)}
        layer |= self._mlp_layer(w, i, release)
        for key, name in (("input_norm", "input_layernorm"),
                          ("post_norm", "post_attention_layernorm")):
            layer[key] = self.norm_weight(w.pop(f"{prefix}{name}.weight"))
        return layer

    def _mlp_layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        layer = super()._mlp_layer(w, i, release)
        if "experts" not in layer:
            return layer
        spec, ex = self.spec, layer["experts"]
        layer["experts"] = GroupRoutedExperts(
            ex.router, ex.gate_up, ex.down, ex.top_k, False, ex.act,
            n_group=spec.n_group if spec.topk_method == "group_limited_greedy" else 0,
            topk_group=spec.topk_group, scale=spec.routed_scaling_factor)
        shared = f"model.layers.{i}.mlp.shared_experts."
        if spec.num_shared_experts:
            layer["shared_gate_up"] = self._linear(
                w, [shared + "gate_proj", shared + "up_proj"], "gate_up", release)
            layer["shared_down"] = self._linear(w, [shared + "down_proj"], "down", release)
        return layer

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        out = super()._mlp(layer, x)
        if "shared_down" in layer:
            out = out + layer["shared_down"](self.act(layer["shared_gate_up"](x)))
        return out

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta, store):
        """Hidden states [T, hidden] after the final norm (:meth:`Decoder.forward`, with
        the absorbed MLA of :mod:`.latent_attention` as each layer's attention)."""
        ops, eps = self.ops, self.spec.rms_norm_eps
        h = self.embed_rows(input_ids)
        delta = None
        for i, layer in enumerate(self.layers):
            h, x = ops.add_rms_norm(h, delta, layer["input_norm"], eps)
            mla = layer["mla"]
            q, entry = mla.query_and_entry(x, positions, self.ropes[i])
            out = mla.output(self.attention(i, q, entry, entry, meta, store))
            h, x = ops.add_rms_norm(h, out, layer["post_norm"], eps)
            delta = self._mlp(layer, x)
        return ops.add_rms_norm(h, delta, self.final_norm, eps)[1]

    @staticmethod
    def class_linears(layer: dict, shape_class: str) -> list[Linear]:
        """``qkv``: MLA's q and kv_a projections; ``o``; ``gate_up`` / ``down``: the dense
        MLP's, or the routed experts' then the shared experts'."""
        mla = layer["mla"]
        if shape_class in ("qkv", "o"):
            return [lin for lin in mla.linears() if (lin is mla.o) == (shape_class == "o")]
        shared = [layer[f"shared_{shape_class}"]] if f"shared_{shape_class}" in layer else []
        return Decoder.class_linears(layer, shape_class) + shared

    def _dense_linears(self, layer: dict) -> list[Linear]:
        """A layer's Linears read whole every step: attention, dense or shared MLP."""
        return [lin for cls in ("qkv", "o") for lin in self.class_linears(layer, cls)] + [
            layer[k] for k in ("gate_up", "down", "shared_gate_up", "shared_down")
            if k in layer]

    @property
    def decode_weight_bytes(self) -> int:
        """As :attr:`Decoder.decode_weight_bytes`, with MLA's Linears and ``kv_b_proj``."""
        k = self.spec.num_experts_per_tok
        dense = sum(lin.nbytes for layer in self.layers for lin in self._dense_linears(layer))
        absorbed = sum(layer["mla"].nbytes_absorbed for layer in self.layers)
        routed = sum(ex.router.nbytes + k * ex.expert_bytes for ex in self.experts)
        return dense + absorbed + routed + self.lm_head.nbytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight held (as :attr:`Decoder.weight_bytes`)."""
        linears = [self.lm_head] + ([] if self.embed is self.lm_head else [self.embed])
        held = sum(ex.nbytes for ex in self.experts) + self.final_norm.nbytes
        for layer in self.layers:
            mla = layer["mla"]
            linears += self._dense_linears(layer)
            held += mla.nbytes_absorbed + mla.kv_a_norm.nbytes + layer["input_norm"].nbytes
            held += layer["post_norm"].nbytes + (0 if mla.q_a_norm is None
                                                 else mla.q_a_norm.nbytes)
        return held + sum(lin.nbytes + (0 if lin.bias is None else lin.bias.nbytes)
                          for lin in linears)
