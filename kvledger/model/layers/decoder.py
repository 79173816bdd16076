"""The decoder forward pass in plain PyTorch, reading and writing the paged KV cache, composed
per layer of an attention block and an MLP block of the shared layers, chosen by the spec; the
families that are this decoder with options pick it (``kvledger.model.families``).

Architecture (Touvron et al., "LLaMA", arXiv:2302.13971): token embedding -> N x [RMSNorm ->
attention -> residual -> RMSNorm -> MLP -> residual] -> RMSNorm -> LM head (tied or untied).
Each layer holds ``attn``, ``mlp`` and its norms:

- ``attn``: self-attention (:class:`.attention.SelfAttention`: q / k norms, biases, partial
  and scaled RoPE, sinks), or on an ``mla`` layer multi-head latent attention
  (:class:`.latent_attention.LatentAttention`, DeepSeek-V2), or on a state layer the family's
  state mixer (:meth:`Decoder.state_mixer`, in a :class:`.state_block.StateBlock`: LFM2's
  short convolution); the sliding layers' own RoPE base
  when the spec has one (Gemma 3, OLMo 3); windows, score scale and soft-capping are the
  backend's per-layer parameters, which each block completes (sinks, MLA's YaRN factor);
- ``mlp``: a gated MLP (:class:`.mlp.GatedMLP`: SwiGLU, or GeGLU for ``gelu_pytorch_tanh``),
  or on the spec's MoE layers routed experts (:class:`.experts.Experts`: gpt-oss's clamped
  SwiGLU when the spec sets ``swiglu_limit``; DeepSeekMoE's group routing, scaling and shared
  experts, :class:`.experts.GroupRoutedExperts`);
- norms: before attention and before the MLP, and after them too ("sandwich", Gemma 2/3), or
  only after them (OLMo: :meth:`Decoder.norm_names`), each weight offset by
  :attr:`Decoder.NORM_OFFSET` (Gemma's ``1 + w``).

Also: an embedding scaled by sqrt(hidden), rounded to the model's dtype first
(:attr:`Decoder.SCALED_EMBEDDING`, Gemma), final-logit soft-capping; the spec's µP
multipliers (``ModelSpec.mup``, Granite: the embedding rows times ``embedding_multiplier``,
each block's output times ``residual_multiplier`` before it joins the residual stream, the
logits divided by ``logits_scaling``); no RoPE table at all when the spec's
``position_embedding_type`` is ``nope`` (Granite-4.0-H's attention layers). Which options a family
computes is its descriptor's ``runs``: a spec that needs another is refused at start.

For speed on CPU the Q/K/V projections are fused into one matrix and gate/up into another, so a
layer runs four matmuls (:mod:`.linears`). In bf16 each matrix shape class (``qkv``, ``o``,
``gate_up``, ``down``, ``lm_head``) is held in the weight format the device chose
(:meth:`kvledger.device.Device.weight_formats`); a tied embedding shares the LM head's copy. In
fp32 every weight is dense, and logits match Hugging Face to ~1e-5. The element-wise ops
between the matmuls are the device's fused ones (:meth:`kvledger.device.Device.fused_ops`,
formulas in :mod:`kvledger.device.ops`). Q is never cached: only the K/V of new tokens go to the
store (seed §2.1).
"""

from __future__ import annotations

import torch

from kvledger.model.layers.attention import SelfAttention
from kvledger.model.layers.experts import Experts, GroupRoutedExperts
from kvledger.model.layers.latent_attention import LatentAttention
from kvledger.model.layers.linears import (
    fused_linear,
    held,
    held_bytes,
    kquant_classes,
    one_linear,
    q4_classes,
)
from kvledger.model.layers.mlp import GatedMLP, SigmoidGatedMLP
from kvledger.model.layers.rotary import InterleavedRope, RotaryEmbedding
from kvledger.model.layers.state_block import StateBlock
from kvledger.model.linear import Linear
from kvledger.spec import MLA, SLIDING, STATE_KINDS, ModelSpec, MuP

SHAPE_CLASSES = ("qkv", "o", "gate_up", "down")
"""A layer's shape classes of Linears (beside the model's ``lm_head``)."""


class Decoder:
    """Weights and forward pass of a decoder-only causal LM (module docstring).

    Args:
        spec: the architecture (a spec its family runs: ``kvledger.model.families``).
        weights: the common parameter names -> tensors ([out, in] for projections).
        dtype: compute dtype (torch.float32 or torch.bfloat16).
        device: a ``kvledger.device.Device``: its weight formats, GEMM paths, fused ops and
            kernels.
        attention: the attention backend, its per-layer parameters set by the engine (each
            layer's block completes them: sinks, MLA's YaRN factor).
        formats: weight format per shape class (``{"qkv": "int4", "lm_head": "int8", ...}``);
            classes left out are dense; None asks the device. Ignored in fp32.
    """

    NORM_OFFSET = 0.0
    """Added to every RMSNorm weight as loaded: Gemma's ``(1 + w)`` form is 1."""
    SCALED_EMBEDDING = False
    """The embedding rows are multiplied by sqrt(hidden) (Gemma)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 *, device, attention, formats: dict[str, str] | None = None):
        self.spec, self.dtype, self.attention = spec, dtype, attention
        self.kernels = device.kernels
        self.ops = device.fused_ops(spec)
        gemm = {}
        if dtype != torch.bfloat16:
            formats = {}
        elif formats is None:
            formats = device.weight_formats(spec, q4_classes(weights), kquant_classes(weights))
            gemm = device.gemm_paths(spec, formats)
        self.formats = dict(formats)
        self.act = self.ops.gelu_tanh_mul if spec.mlp.act == "gelu_pytorch_tanh" \
            else self.ops.silu_mul
        release = getattr(weights, "release", None) or (lambda tensor: None)
        w = {name: held(t, dtype) for name, t in weights.items()}
        embed = w.pop("model.embed_tokens.weight")
        head = w.pop("lm_head.weight", None)
        self.lm_head = one_linear(embed if head is None else head,
                                  self.formats.get("lm_head", "dense"), release, dtype,
                                  self.kernels)
        tied_rows = head is None and self.lm_head.format != "int4"
        self.embed = self.lm_head if tied_rows else one_linear(embed, "kquant-torch", None, dtype,
                                                               self.kernels)
        for source in (embed, head):
            if source is not None:
                release(source)
        del embed, head
        self.normalizer = torch.tensor(spec.hidden_size ** 0.5, dtype=dtype)
        self.mup = spec.mup or MuP()
        self.final_norm = self.norm_weight(w.pop("model.norm.weight"))
        self.ropes = self._ropes()
        self.rope = self.ropes[0]  # the turn of retained keys (retention runs on one RoPE)
        self.layers = []
        for i in range(spec.num_layers):
            self.layers.append(self._layer(w, i, release))
            for cls, choice in gemm.items():
                for linear in self.class_linears(self.layers[-1], cls) if choice else ():
                    linear.use_gemm(*choice)
        attention.set_layers([layer["attn"].backend_params(how)
                              for layer, how in zip(self.layers, attention.layers)])

    def norm_weight(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An RMSNorm weight as the ops take it: ``weight + NORM_OFFSET``, a new tensor (no
        view of a mapped cache), in ``dtype`` or as held (:func:`.linears.held`: fp32 norms
        stay fp32 beside bf16 rows, as the fused add + RMSNorm takes them)."""
        return (weight.float() + self.NORM_OFFSET).to(dtype or weight.dtype)

    def _ropes(self) -> list:
        """One RoPE table per layer: the spec's, for the sliding layers its local base
        (``rope_local_base_freq``, unscaled) when it has one, for ``mla`` layers DeepSeek's
        interleaved pairs; None on every layer of a ``nope`` spec."""
        spec = self.spec
        if spec.rope.position_embedding_type == "nope":
            return [None] * spec.num_layers
        tables = {None: RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                        spec.rope.theta, spec.rope.scaling, self.dtype,
                                        spec.rotary_dim)}
        if spec.rope.local_base_freq is not None:
            tables[SLIDING] = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                              spec.rope.local_base_freq, None, self.dtype,
                                              spec.rotary_dim)
        if MLA in spec.layers.types:
            tables = {None: InterleavedRope(spec)}
        return [tables.get(kind, tables[None]) for kind in spec.layers.types]

    def norm_names(self) -> dict[str, str]:
        """A layer's norms: key -> weight name under ``model.layers.{i}.``; with sandwich norms
        the norm before the MLP is ``pre_feedforward_layernorm`` and the two after attention
        and the MLP are ``attn_out_norm`` / ``mlp_out_norm``; a key the layer lacks is no
        norm there (OLMo's layers have neither ``input_norm`` nor ``post_norm``)."""
        if self.spec.norm.per_layer == 4:
            return {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                    "post_norm": "pre_feedforward_layernorm",
                    "mlp_out_norm": "post_feedforward_layernorm"}
        return {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}

    def _layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        """Layer ``i``: its attention block (by its kind), MLP block (:meth:`_mlp`) and norms."""
        prefix, spec = f"model.layers.{i}.", self.spec

        def linear(stems: list[str], shape_class: str) -> Linear:
            return fused_linear(w, stems, self.formats.get(shape_class, "dense"), release,
                                self.dtype, self.kernels)

        if spec.layers.types[i] in STATE_KINDS:
            attn = StateBlock(self.state_mixer(w, prefix, linear, i))
        elif spec.layers.types[i] == MLA:
            attn = LatentAttention(spec, w, prefix, linear, self.ropes[i], self.dtype)
        else:
            attn = SelfAttention(spec, w, prefix, linear, self.norm_weight, self.ropes[i],
                                 self.ops, self.dtype)
        layer = {"attn": attn, "mlp": self._mlp(w, linear, i)}
        for key, name in self.norm_names().items():
            layer[key] = self.norm_weight(w.pop(f"{prefix}{name}.weight"))
        return layer

    def state_mixer(self, w: dict[str, torch.Tensor], prefix: str, linear, i: int):
        """Layer ``i``'s state mixer (:mod:`.state`'s interface), for a state layer kind: the
        family's (a subclass computes it; the plain decoder has none)."""
        raise NotImplementedError(f"{type(self).__name__} has no mixer for a "
                                  f"{self.spec.layers.types[i]} layer")

    def _mlp(self, w: dict[str, torch.Tensor], linear, i: int) -> GatedMLP | Experts:
        """Layer ``i``'s MLP: gate / up / down, or on an MoE layer its router and experts (each
        in the ``gate_up`` / ``down`` classes' formats), routed as the spec says, and the
        shared experts (DeepSeek's, Granite's; Qwen-MoE's behind a sigmoid gate)."""
        mlp, spec = f"model.layers.{i}.mlp.", self.spec

        def gated(stem: str) -> GatedMLP:
            return GatedMLP(linear([stem + "gate_proj", stem + "up_proj"], "gate_up"),
                            linear([stem + "down_proj"], "down"), self.act)

        if not spec.is_moe_layer(i):
            return gated(mlp)
        router = Linear(w.pop(mlp + "gate.weight"), w.pop(mlp + "gate.bias", None))
        gate_up, down = [], []
        for e in range(spec.experts.count):
            stem = f"{mlp}experts.{e}."
            gate_up.append(linear([stem + "gate_proj", stem + "up_proj"], "gate_up"))
            down.append(linear([stem + "down_proj"], "down"))
        ex = spec.experts
        shared = gated(mlp + "shared_experts.") if ex.shared_count else None
        if shared is not None and ex.shared_gate:
            shared = SigmoidGatedMLP(shared.gate_up, shared.down, self.act,
                                     Linear(w.pop(mlp + "shared_expert_gate.weight")))
        args = (router, gate_up, down, ex.per_token, ex.norm_topk_prob, self.expert_act)
        if ex.topk_method == "greedy" and ex.routed_scaling_factor == 1.0:
            return Experts(*args, shared=shared)
        return GroupRoutedExperts(
            *args, n_group=ex.n_group if ex.topk_method == "group_limited_greedy" else 0,
            topk_group=ex.topk_group, scale=ex.routed_scaling_factor, shared=shared)

    def expert_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' activation ``[T, 2f] -> [T, f]`` of gate then up columns: the MLP's
        (:attr:`act`), or gpt-oss's clamped SwiGLU when the spec sets ``swiglu_limit``."""
        if self.spec.experts.swiglu_limit is not None:
            return self.ops.clamped_swiglu(gate_up, self.spec.experts.swiglu_alpha,
                                           self.spec.experts.swiglu_limit)
        return self.act(gate_up)

    @staticmethod
    def class_linears(layer: dict, shape_class: str) -> list[Linear]:
        """A layer's Linears of one shape class (``qkv``, ``o``: its attention's; ``gate_up``,
        ``down``: its MLP's, an MoE layer's experts' then its shared experts')."""
        return layer["attn"].linears(shape_class) + layer["mlp"].linears(shape_class)

    @property
    def experts(self) -> list[Experts]:
        """The MoE layers' experts, in layer order."""
        return [layer["mlp"] for layer in self.layers if isinstance(layer["mlp"], Experts)]

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows [T, hidden] of token ids [T] (times sqrt(hidden) when
        :attr:`SCALED_EMBEDDING`, times the spec's ``embedding_multiplier``)."""
        rows = self.embed.rows(input_ids, self.dtype)
        rows = rows * self.normalizer if self.SCALED_EMBEDDING else rows
        scale = self.mup.embedding_multiplier
        return rows if scale == 1.0 else rows * scale

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, store
                ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for token ids [T] at positions [T]
        (``meta``: the step's ``AttentionMetadata``; ``store``: the KV store or None).

        Each residual add is fused with the RMSNorm after it (``h`` is updated in place); a
        block's output joins it times the spec's ``residual_multiplier``.
        """
        ops, eps, residual = self.ops, self.spec.norm.eps, self.mup.residual_multiplier
        h = self.embed_rows(input_ids)
        delta = None
        for i, layer in enumerate(self.layers):
            h, x = self._add_norm(h, delta, layer, "input_norm")
            out = layer["attn"](i, x, positions, self.attention, meta, store)
            if "attn_out_norm" in layer:
                out = ops.add_rms_norm(out, None, layer["attn_out_norm"], eps)[1]
            if residual != 1.0:
                out = out * residual
            h, x = self._add_norm(h, out, layer, "post_norm")
            delta = layer["mlp"](x)
            if "mlp_out_norm" in layer:
                delta = ops.add_rms_norm(delta, None, layer["mlp_out_norm"], eps)[1]
            if residual != 1.0:
                delta = delta * residual
        return ops.add_rms_norm(h, delta, self.final_norm, eps)[1]

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, layer: dict, norm: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its RMSNorm by ``layer[norm]``), fused; a layer without that norm (OLMo's
        post-norm layers) takes the sum itself."""
        if norm in layer:
            return self.ops.add_rms_norm(h, delta, layer[norm], self.spec.norm.eps)
        h = h if delta is None else h + delta
        return h, h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32 for hidden states [N, hidden], divided by the spec's
        ``logits_scaling``, soft-capped when the spec says so."""
        logits = self.lm_head(hidden).float()
        if self.mup.logits_scaling != 1.0:
            logits = logits / self.mup.logits_scaling
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one batch-1 decode step reads: every layer's blocks
        (``decode_bytes``: attention and dense MLPs whole, per MoE layer its router and
        ``num_experts_per_tok`` experts) and the LM head; the embedding table is gathered by
        row, not read whole."""
        blocks = sum(layer[b].decode_bytes for layer in self.layers for b in ("attn", "mlp"))
        return blocks + self.lm_head.nbytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight held: every layer's blocks and norms, the LM head, the
        embedding when it is not the LM head's, and the final norm."""
        linears = [self.lm_head] + ([] if self.embed is self.lm_head else [self.embed])
        total = sum(held_bytes(lin) for lin in linears) + self.final_norm.nbytes
        for layer in self.layers:
            total += layer["attn"].held_bytes + layer["mlp"].held_bytes
            total += sum(t.nbytes for key, t in layer.items() if key.endswith("norm"))
        return total

    @property
    def weight_formats(self) -> dict[str, str]:
        """Format held per shape class (a request the weights cannot meet is dense);
        ``gate_up`` / ``down`` are the experts' on an MoE model (each expert holds one; a dense
        MLP layer takes the same class's format)."""
        layer = next((layer for layer in self.layers if isinstance(layer["mlp"], Experts)),
                     self.layers[0])
        held_formats = {cls: self.class_linears(layer, cls)[0].format for cls in SHAPE_CLASSES}
        return {**held_formats, "lm_head": self.lm_head.format}
