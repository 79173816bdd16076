"""The decoder forward pass in plain PyTorch, reading and writing the paged KV cache, composed
from the shared layers; the families that are this decoder with options pick it
(``kvledger.model.families``).

Architecture (Touvron et al., "LLaMA", arXiv:2302.13971): token embedding -> N x [RMSNorm ->
attention (:mod:`.attention`) -> residual -> RMSNorm -> MLP -> residual] -> RMSNorm -> LM head
(tied or untied). The options, each switched on by the spec and its weights, and which of them
a family computes is its descriptor's ``runs`` (a spec that needs another is refused at start):

- attention: q / k RMSNorm per head (Qwen3, Gemma 3) or over the whole projection (OLMo),
  biases, a partial rotary factor and
  LongRoPE / YaRN (:mod:`.rotary`), a second RoPE base for the sliding layers (Gemma 3),
  sliding windows, a score scale, score soft-capping and sink logits (gpt-oss: the sinks are
  weights, handed to the backend, :func:`.attention.with_sinks`);
- norms after attention and after the MLP ("sandwich", Gemma 2/3), or only there (OLMo:
  :meth:`Decoder.norm_names`), each norm weight offset by :attr:`Decoder.NORM_OFFSET` (Gemma's
  ``1 + w``);
- the MLP: a gated one (SwiGLU, or GeGLU for ``gelu_pytorch_tanh``), or on a spec's MoE layers
  routed experts (:mod:`.experts`; gpt-oss's biased experts with the clamped SwiGLU when the
  spec sets ``swiglu_limit``);
- an embedding scaled by sqrt(hidden), rounded to the model's dtype first
  (:attr:`Decoder.SCALED_EMBEDDING`, Gemma), final-logit soft-capping.

For speed on CPU the Q/K/V projections are fused into one matrix and gate/up into another, so a
layer runs four matmuls (:mod:`.linears`). In bf16 each matrix shape class (``qkv``, ``o``,
``gate_up``, ``down``, ``lm_head``) is held in the weight format the device chose
(:meth:`kvledger.device.Device.weight_formats`); a tied embedding shares the LM head's copy. In
fp32 every weight is dense, and logits match Hugging Face to ~1e-5. The element-wise ops
between the matmuls are the device's fused ones (:meth:`kvledger.device.Device.fused_ops`,
formulas in :mod:`kvledger.model.ops`). Q is never cached: only the K/V of new tokens go to the
store (seed §2.1).
"""

from __future__ import annotations

import torch

from kvledger.model.layers.attention import attention_linears, project_qkv, with_sinks
from kvledger.model.layers.experts import Experts
from kvledger.model.layers.linears import (
    fused_linear,
    held,
    kquant_classes,
    one_linear,
    q4_classes,
)
from kvledger.model.layers.rotary import RotaryEmbedding
from kvledger.model.linear import Linear
from kvledger.spec import SLIDING, ModelSpec

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
        attention: the attention backend, its per-layer parameters set by the engine.
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
        self.act = self.ops.gelu_tanh_mul if spec.hidden_act == "gelu_pytorch_tanh" \
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
        self.final_norm = self.norm_weight(w.pop("model.norm.weight"))
        self.layers = []
        for i in range(spec.num_layers):
            self.layers.append(self._layer(w, i, release))
            for cls, choice in gemm.items():
                for linear in self.class_linears(self.layers[-1], cls) if choice else ():
                    linear.use_gemm(*choice)
        if spec.attention_sinks:
            with_sinks(attention, [layer["sinks"] for layer in self.layers])
        self.ropes = self._ropes()
        self.rope = self.ropes[0]  # the turn of retained keys (retention runs on one RoPE)
        self.q_size = spec.num_attention_heads * spec.head_dim

    def norm_weight(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An RMSNorm weight as the ops take it: ``weight + NORM_OFFSET``, a new tensor (no
        view of a mapped cache), in ``dtype`` or as held (:func:`.linears.held`: fp32 norms
        stay fp32 beside bf16 rows, as the fused add + RMSNorm takes them)."""
        return (weight.float() + self.NORM_OFFSET).to(dtype or weight.dtype)

    def _ropes(self) -> list[RotaryEmbedding]:
        """One RoPE table per layer: the spec's, or for the sliding layers its local base
        (``rope_local_base_freq``, unscaled) when it has one (Gemma 3)."""
        spec = self.spec
        tables = {None: RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                        spec.rope_theta, spec.rope_scaling, self.dtype,
                                        spec.rotary_dim)}
        if spec.rope_local_base_freq is not None:
            tables[SLIDING] = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                              spec.rope_local_base_freq, None, self.dtype,
                                              spec.rotary_dim)
        return [tables.get(kind, tables[None]) for kind in spec.layer_types]

    def norm_names(self) -> dict[str, str]:
        """A layer's norms: key -> weight name under ``model.layers.{i}.``; with sandwich norms
        the norm before the MLP is ``pre_feedforward_layernorm`` and the two after attention
        and the MLP are ``attn_out_norm`` / ``mlp_out_norm``; a key the layer lacks is no
        norm there (OLMo's layers have neither ``input_norm`` nor ``post_norm``)."""
        if self.spec.norms_per_layer == 4:
            return {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                    "post_norm": "pre_feedforward_layernorm",
                    "mlp_out_norm": "post_feedforward_layernorm"}
        return {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}

    def _layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        """Layer ``i``'s norms, attention Linears (:func:`.attention.attention_linears`), MLP
        (:meth:`_mlp_layer`) and sink logits [heads] in fp32 when the spec has them."""
        prefix = f"model.layers.{i}."
        layer = attention_linears(w, prefix, self.formats, release, self.dtype, self.kernels)
        layer |= self._mlp_layer(w, i, release)
        norms = self.norm_names()
        if self.spec.qk_norm:
            norms |= {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        for key, name in norms.items():  # q / k norms go through F.rms_norm on compute rows
            dtype = self.dtype if key in ("q_norm", "k_norm") else None
            layer[key] = self.norm_weight(w.pop(f"{prefix}{name}.weight"), dtype)
        if self.spec.attention_sinks:
            layer["sinks"] = w.pop(f"{prefix}self_attn.sinks").float()
        return layer

    def _linear(self, w: dict, stems: list[str], shape_class: str, release) -> Linear:
        return fused_linear(w, stems, self.formats.get(shape_class, "dense"), release,
                            self.dtype, self.kernels)

    def _mlp_layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        """Layer ``i``'s MLP: ``gate_up`` (gate rows, then up) and ``down`` Linears, or on an
        MoE layer its :class:`.experts.Experts`, each expert in the ``gate_up`` / ``down``
        classes' formats."""
        mlp = f"model.layers.{i}.mlp."
        if not self.spec.is_moe_layer(i):
            return {"gate_up": self._linear(w, [mlp + "gate_proj", mlp + "up_proj"], "gate_up",
                                            release),
                    "down": self._linear(w, [mlp + "down_proj"], "down", release)}
        router = Linear(w.pop(mlp + "gate.weight"), w.pop(mlp + "gate.bias", None))
        gate_up, down = [], []
        for e in range(self.spec.num_experts):
            stem = f"{mlp}experts.{e}."
            gate_up.append(self._linear(w, [stem + "gate_proj", stem + "up_proj"], "gate_up",
                                        release))
            down.append(self._linear(w, [stem + "down_proj"], "down", release))
        return {"experts": Experts(router, gate_up, down, self.spec.num_experts_per_tok,
                                   self.spec.norm_topk_prob, self.expert_act)}

    def expert_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' activation ``[T, 2f] -> [T, f]`` of gate then up columns: the MLP's
        (:attr:`act`), or gpt-oss's clamped SwiGLU when the spec sets ``swiglu_limit``."""
        if self.spec.swiglu_limit is not None:
            return self.ops.clamped_swiglu(gate_up, self.spec.swiglu_alpha,
                                           self.spec.swiglu_limit)
        return self.act(gate_up)

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output [T, hidden] of normed hidden states x [T, hidden]."""
        if "experts" in layer:
            return layer["experts"](x)
        return layer["down"](self.act(layer["gate_up"](x)))

    @staticmethod
    def class_linears(layer: dict, shape_class: str) -> list[Linear]:
        """A layer's Linears of one shape class (``qkv``, ``o``, ``gate_up``, ``down``; an MoE
        layer's ``gate_up`` / ``down``: its experts')."""
        if shape_class not in layer and "experts" in layer:
            return layer["experts"].linears(shape_class)
        return [layer[shape_class]] if shape_class in layer else []

    @property
    def experts(self) -> list[Experts]:
        """The MoE layers' experts, in layer order."""
        return [layer["experts"] for layer in self.layers if "experts" in layer]

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows [T, hidden] of token ids [T] (times sqrt(hidden) when
        :attr:`SCALED_EMBEDDING`)."""
        rows = self.embed.rows(input_ids, self.dtype)
        return rows * self.normalizer if self.SCALED_EMBEDDING else rows

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, store
                ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for token ids [T] at positions [T]
        (``meta``: the step's ``AttentionMetadata``; ``store``: the KV store or None).

        Each residual add is fused with the RMSNorm after it (``h`` is updated in place).
        """
        ops, eps = self.ops, self.spec.rms_norm_eps
        h = self.embed_rows(input_ids)
        delta = None
        for i, layer in enumerate(self.layers):
            h, x = self._add_norm(h, delta, layer, "input_norm")
            q, k, v = project_qkv(layer, x, positions, self.ropes[i], self.spec, ops)
            attn = self.attention(i, q, k, v, meta, store)
            out = layer["o"](attn.reshape(-1, self.q_size))
            if "attn_out_norm" in layer:
                out = ops.add_rms_norm(out, None, layer["attn_out_norm"], eps)[1]
            h, x = self._add_norm(h, out, layer, "post_norm")
            delta = self._mlp(layer, x)
            if "mlp_out_norm" in layer:
                delta = ops.add_rms_norm(delta, None, layer["mlp_out_norm"], eps)[1]
        return ops.add_rms_norm(h, delta, self.final_norm, eps)[1]

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, layer: dict, norm: str
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its RMSNorm by ``layer[norm]``), fused; a layer without that norm (OLMo's
        post-norm layers) takes the sum itself."""
        if norm in layer:
            return self.ops.add_rms_norm(h, delta, layer[norm], self.spec.rms_norm_eps)
        h = h if delta is None else h + delta
        return h, h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32 for hidden states [N, hidden], soft-capped when the spec
        says so."""
        logits = self.lm_head(hidden).float()
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one batch-1 decode step reads: every layer's attention Linears and
        dense MLPs, the LM head, and per MoE layer its router and ``num_experts_per_tok``
        experts (a larger batch reads the distinct experts its tokens chose:
        :attr:`.experts.Experts.bytes_read`); the embedding table is gathered by row, not read
        whole."""
        k = self.spec.num_experts_per_tok
        dense = [layer[cls] for layer in self.layers for cls in SHAPE_CLASSES if cls in layer]
        routed = sum(ex.router.nbytes + k * ex.expert_bytes for ex in self.experts)
        return sum(lin.nbytes for lin in dense) + self.lm_head.nbytes + routed

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight held: the Linears (biases included, every expert and router),
        the embedding when it is not the LM head's, and the norms."""
        linears = [self.lm_head] + ([] if self.embed is self.lm_head else [self.embed])
        vectors = [self.final_norm]
        for layer in self.layers:
            linears += [lin for cls in SHAPE_CLASSES for lin in self.class_linears(layer, cls)]
            linears += [layer["experts"].router] if "experts" in layer else []
            vectors += [t for key, t in layer.items() if key.endswith("norm")]
        vectors += [lin.bias for lin in linears if lin.bias is not None]
        return sum(lin.nbytes for lin in linears) + sum(t.nbytes for t in vectors)

    @property
    def weight_formats(self) -> dict[str, str]:
        """Format held per shape class (a request the weights cannot meet is dense);
        ``gate_up`` / ``down`` are the experts' on an MoE model (each expert holds one; a dense
        MLP layer takes the same class's format)."""
        layer = next((layer for layer in self.layers if "experts" in layer), self.layers[0])
        held_formats = {cls: self.class_linears(layer, cls)[0].format for cls in SHAPE_CLASSES}
        return {**held_formats, "lm_head": self.lm_head.format}
