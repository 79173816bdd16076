"""DeepSeek-V2 and V2-Lite (arXiv:2405.04434; transformers' ``DeepseekV2ForCausalLM``): the Llama
decoder with multi-head latent attention (:mod:`.mla`) on every layer, a dense SwiGLU MLP on the
first ``first_k_dense_replace`` layers and DeepSeekMoE after them.

DeepSeekMoE (§2.2, transformers' ``DeepseekV2TopkRouter`` / ``DeepseekV2Moe``): router
probabilities ``p = softmax(W_r x)`` in fp32 over all routed experts; ``greedy`` takes the top
``num_experts_per_tok``; ``group_limited_greedy`` first keeps the ``topk_group`` groups (of
``n_group`` equal groups of experts) with the highest maximum p and takes the top-k among their
experts; the chosen weights are never renormalised and are multiplied by
``routed_scaling_factor``. The shared experts are one SwiGLU MLP of ``num_shared_experts x
moe_intermediate_size`` added for every token. Dense layers past the first k
(``moe_layer_freq``) and ``norm_topk_prob`` are refused at start (``spec/runnable.py``):
transformers' model has neither.
"""

from __future__ import annotations

import torch

from kvledger.model.experts import Experts
from kvledger.model.linear import Linear
from kvledger.model.llama import _fused_linear
from kvledger.model.mla import InterleavedRope, LatentAttention
from kvledger.model.moe import MoEModel
from kvledger.model.rope import yarn_softmax_factor


class GroupRoutedExperts(Experts):
    """:class:`Experts` routed as DeepSeekMoE (module docstring)."""

    def __init__(self, *args, n_group: int, topk_group: int, scale: float) -> None:
        super().__init__(*args)
        self.n_group, self.topk_group, self.scale = n_group, topk_group, scale

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.router(x).float(), dim=-1)
        scores = probs
        if self.n_group > 1:
            groups = probs.view(len(probs), self.n_group, -1)
            keep = torch.zeros(groups.shape[:2], dtype=torch.bool)
            keep.scatter_(1, groups.amax(-1).topk(self.topk_group, dim=-1).indices, True)
            scores = (groups * keep[..., None]).view_as(probs)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        return probs, weights * self.scale, chosen


class DeepseekModel(MoEModel):
    """DeepSeek-V2: :class:`MoEModel` whose layers hold ``mla`` (:class:`LatentAttention`) and,
    on MoE layers, ``experts`` and the shared experts' ``shared_gate_up`` / ``shared_down``."""

    FAMILY = "deepseek"

    def __init__(self, spec, weights, dtype, attention=None, formats=None, device=None) -> None:
        super().__init__(spec, weights, dtype, attention=attention, formats=formats,
                         device=device)
        factor = yarn_softmax_factor(spec.rope.scaling)
        self.attention.set_layers([
            type(how)(how.scale * factor, how.window, how.softcap)
            for how in self.attention.layers])

    def _ropes(self) -> list[InterleavedRope]:
        return [InterleavedRope(self.spec)] * self.spec.num_layers

    def _layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        prefix, dtype = f"model.layers.{i}.", self.dtype

        def linear(stems: list[str], shape_class: str) -> Linear:
            return _fused_linear(w, stems, self.formats.get(shape_class, "dense"), release,
                                 dtype)

        layer = {"mla": LatentAttention(self.spec, w, prefix, linear, dtype)}
        layer |= self._mlp_layer(w, i, release)
        for key, name in (("input_norm", "input_layernorm"),
                          ("post_norm", "post_attention_layernorm")):
            layer[key] = self.norm_weight(w.pop(f"{prefix}{name}.weight"))
        return layer

    def _mlp_layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        layer = super()._mlp_layer(w, i, release)
        if "experts" not in layer:
            return layer
        spec, ex, routing = self.spec, layer["experts"], self.spec.experts
        layer["experts"] = GroupRoutedExperts(
            ex.router, ex.gate_up, ex.down, ex.top_k, False, ex.act,
            n_group=routing.n_group if routing.topk_method == "group_limited_greedy" else 0,
            topk_group=routing.topk_group, scale=routing.routed_scaling_factor)
        shared, formats = f"model.layers.{i}.mlp.shared_experts.", self.formats
        if spec.experts.shared_count:
            layer["shared_gate_up"] = _fused_linear(
                w, [shared + "gate_proj", shared + "up_proj"], formats.get("gate_up", "dense"),
                release, self.dtype)
            layer["shared_down"] = _fused_linear(w, [shared + "down_proj"],
                                                 formats.get("down", "dense"), release,
                                                 self.dtype)
        return layer

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        out = super()._mlp(layer, x)
        if "shared_down" in layer:
            out = out + layer["shared_down"](self.act(layer["shared_gate_up"](x)))
        return out

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta, store):
        """Hidden states [T, hidden] after the final norm (:meth:`LlamaModel.forward`, with
        the absorbed MLA of :mod:`.mla` as each layer's attention)."""
        ops, eps = self.ops, self.spec.norm.eps
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
        return MoEModel.class_linears(layer, shape_class) + shared

    def _dense_linears(self, layer: dict) -> list[Linear]:
        """A layer's Linears read whole every step: attention, dense or shared MLP."""
        return [lin for cls in ("qkv", "o") for lin in self.class_linears(layer, cls)] + [
            layer[k] for k in ("gate_up", "down", "shared_gate_up", "shared_down")
            if k in layer]

    @property
    def decode_weight_bytes(self) -> int:
        """As :attr:`MoEModel.decode_weight_bytes`, with MLA's Linears and ``kv_b_proj``."""
        k = self.spec.experts.per_token
        dense = sum(lin.nbytes for layer in self.layers for lin in self._dense_linears(layer))
        absorbed = sum(layer["mla"].nbytes_absorbed for layer in self.layers)
        routed = sum(ex.router.nbytes + k * ex.expert_bytes for ex in self.experts)
        return dense + absorbed + routed + self.lm_head.nbytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight held (as :attr:`MoEModel.weight_bytes`)."""
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
