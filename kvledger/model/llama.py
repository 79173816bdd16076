"""Llama-family decoder forward pass in plain PyTorch, reading and writing the paged KV cache,
and the hooks the other decoder families (:mod:`.qwen3`, :mod:`.phi3`, :mod:`.gemma`) set.

Architecture (Touvron et al., "LLaMA", arXiv:2302.13971; GQA: Ainslie et al., arXiv:2305.13245):
token embedding -> N x [RMSNorm -> attention (Q, K, V projections, RoPE on Q and K, GQA) ->
residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head (tied or untied).
What a family may add, each switched on by the spec and its weights: per-head RMSNorm of q and
k before RoPE (Qwen3, Gemma 3), a second RoPE base for the sliding layers (Gemma 3), a
partial rotary factor and LongRoPE (:mod:`.rope`), sliding windows, a score scale and score
soft-capping (the attention backend's per-layer parameters, ``engine/attention/layer.py``),
norms after attention and after the MLP ("sandwich", Gemma 2/3), another gated activation, a
scaled embedding, final-logit soft-capping; which of them a family computes is its
``kvledger.spec.runnable.FAMILY_RUNS``, and a spec that needs another is refused at start.

For speed on CPU the Q/K/V projections are fused into one matrix and gate/up into another, so a
layer runs four matmuls. In bf16 each matrix shape class (``qkv``, ``o``, ``gate_up``,
``down``, ``lm_head``) is held in the weight format the device chose
(:meth:`kvledger.device.Device.weight_formats`, :mod:`kvledger.model.linear`; on CPU the kernel
probe measures them); a tied embedding shares the LM head's copy. In fp32 every weight is
dense, and logits match Hugging Face to ~1e-5. The element-wise ops between the matmuls are
the device's fused ones (:meth:`kvledger.device.Device.fused_ops`, formulas in
:mod:`kvledger.model.ops`: residual add + RMSNorm, RoPE on Q and K, SiLU x up). Q is never
cached: only the K/V of new tokens go to the store (seed §2.1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvledger.engine.attention import AttentionBackend, AttentionMetadata, make_backend
from kvledger.engine.attention.layer import layers_of
from kvledger.engine.kv.store import KVStore
from kvledger.errors import UnsupportedModelError
from kvledger.model.kquant import GGMLMatrix, KQuantLinear
from kvledger.model.linear import KQUANT_FORMATS, Q4_FORMATS, Linear, int4_shape_ok
from kvledger.model.rope import RotaryEmbedding
from kvledger.spec import SLIDING, ModelSpec, check_runnable


def _cpu():
    """The CPU with the probe's choices, for a model built without a device."""
    from kvledger.device import resolve
    from kvledger.engine.tuning.tuned import TunedDevice

    return TunedDevice(resolve("cpu"))


class LlamaModel:
    """Weights and forward pass of a Llama-family causal LM.

    Args:
        spec: the architecture.
        weights: Hugging Face Llama parameter names -> tensors ([out, in] for projections).
        dtype: compute dtype (torch.float32 or torch.bfloat16).
        attention: an attention backend or its name (see :mod:`kvledger.engine.attention`);
            None takes ``$KVLEDGER_ATTENTION``, else the kernel choice of the probe.
        formats: weight format per shape class (``{"qkv": "int4", "lm_head": "int8", ...}``);
            classes left out are dense; None asks the device. Ignored in fp32.
        device: the device with the probe's choices
            (``kvledger.engine.tuning.tuned.TunedDevice``); None: the CPU's.

    Raises:
        UnsupportedModelError: a spec the forward would not compute exactly
            (:func:`kvledger.spec.check_runnable`), or one of another family's.
    """

    FAMILY = "llama"
    """The engine family this class runs (``kvledger.spec.runnable.FAMILY_TYPES``)."""
    NORM_OFFSET = 0.0
    """Added to every RMSNorm weight as loaded: Gemma's ``(1 + w)`` form is 1."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 attention: AttentionBackend | str | None = None,
                 formats: dict[str, str] | None = None, device=None):
        family = check_runnable(spec)
        if family != self.FAMILY:
            raise UnsupportedModelError(f"model_type {spec.model_type!r} runs in the {family} "
                                        f"family, not {type(self).__name__}")
        self.spec, self.dtype = spec, dtype
        device = device or _cpu()
        if not isinstance(attention, AttentionBackend):
            attention = make_backend(attention or device.attention_backend(spec), device.kernels)
        self.attention = attention
        attention.set_layers(layers_of(spec))
        self.ops = device.fused_ops(spec)
        gemm = {}
        if dtype != torch.bfloat16:
            formats = {}
        elif formats is None:
            formats = device.weight_formats(spec, _q4_classes(weights), _kquant_classes(weights))
            gemm = device.gemm_paths(spec, formats)
        self.formats = dict(formats)
        release = getattr(weights, "release", None) or (lambda tensor: None)
        w = {name: _held(t, dtype) for name, t in weights.items()}
        embed = w.pop("model.embed_tokens.weight")
        head = w.pop("lm_head.weight", None)
        self.lm_head = _linear(embed if head is None else head,
                               self.formats.get("lm_head", "dense"), release, dtype)
        tied_rows = head is None and self.lm_head.format != "int4"
        self.embed = self.lm_head if tied_rows else _linear(embed, "kquant-torch", None, dtype)
        for source in (embed, head):
            if source is not None:
                release(source)
        del embed, head
        self.final_norm = self.norm_weight(w.pop("model.norm.weight"))
        self.layers = []
        for i in range(spec.num_layers):
            self.layers.append(self._layer(w, i, release))
            for cls, choice in gemm.items():
                for linear in self.class_linears(self.layers[-1], cls) if choice else ():
                    linear.use_gemm(*choice)
        self.ropes = self._ropes()
        self.rope = self.ropes[0]  # the turn of retained keys (retention runs on one RoPE)
        self.q_size = spec.num_attention_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.act = self.ops.silu_mul

    def norm_weight(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An RMSNorm weight as the ops take it: ``weight + NORM_OFFSET``, a new tensor (no
        view of a mapped cache), in ``dtype`` or as held (:func:`_held`: fp32 norms stay fp32
        beside bf16 rows, as the fused add + RMSNorm takes them)."""
        return (weight.float() + self.NORM_OFFSET).to(dtype or weight.dtype)

    def _ropes(self) -> list[RotaryEmbedding]:
        """One RoPE table per layer: the spec's, or for the sliding layers its local base
        (``rope_local_base_freq``, unscaled) when it has one (Gemma 3)."""
        spec = self.spec
        tables = {None: RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                        spec.rope.theta, spec.rope.scaling, self.dtype,
                                        spec.rotary_dim)}
        if spec.rope.local_base_freq is not None:
            tables[SLIDING] = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                              spec.rope.local_base_freq, None, self.dtype,
                                              spec.rotary_dim)
        return [tables.get(kind, tables[None]) for kind in spec.layers.types]

    def _layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        """Layer ``i``'s norms, fused attention Linears (:func:`_fuse_attention`) and MLP
        (:meth:`_mlp_layer`); with sandwich norms the norm before the MLP is
        ``pre_feedforward_layernorm`` and the two after attention and the MLP are
        ``attn_out_norm`` / ``mlp_out_norm``."""
        prefix = f"model.layers.{i}."
        layer = _fuse_attention(w, prefix, self.formats, release, self.dtype)
        layer |= self._mlp_layer(w, i, release)
        norms = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
        if self.spec.norm.per_layer == 4:
            norms = {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                     "post_norm": "pre_feedforward_layernorm",
                     "mlp_out_norm": "post_feedforward_layernorm"}
        if self.spec.attention.qk_norm:
            norms |= {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        for key, name in norms.items():  # q / k norms go through F.rms_norm on compute rows
            dtype = self.dtype if key in ("q_norm", "k_norm") else None
            layer[key] = self.norm_weight(w.pop(f"{prefix}{name}.weight"), dtype)
        return layer

    def _mlp_layer(self, w: dict[str, torch.Tensor], i: int, release) -> dict:
        """Layer ``i``'s MLP: ``gate_up`` (gate rows, then up) and ``down`` Linears."""
        mlp, formats = f"model.layers.{i}.mlp.", self.formats
        return {"gate_up": _fused_linear(w, [mlp + "gate_proj", mlp + "up_proj"],
                                         formats.get("gate_up", "dense"), release, self.dtype),
                "down": _fused_linear(w, [mlp + "down_proj"], formats.get("down", "dense"),
                                      release, self.dtype)}

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output [T, hidden] of normed hidden states x [T, hidden]."""
        return layer["down"](self.act(layer["gate_up"](x)))

    @staticmethod
    def class_linears(layer: dict, shape_class: str) -> list[Linear]:
        """A layer's Linears of one shape class (``qkv``, ``o``, ``gate_up``, ``down``)."""
        return [layer[shape_class]] if shape_class in layer else []

    def embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows [T, hidden] of token ids [T] (Gemma scales them)."""
        return self.embed.rows(input_ids, self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, store: KVStore | None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for token ids [T] at positions [T].

        Each residual add is fused with the RMSNorm after it (``h`` is updated in place).
        """
        ops, eps = self.ops, self.spec.norm.eps
        h = self.embed_rows(input_ids)
        delta = None
        for i, layer in enumerate(self.layers):
            h, x = ops.add_rms_norm(h, delta, layer["input_norm"], eps)
            q, k, v = self._qkv(layer, x, positions, self.ropes[i])
            attn = self.attention(i, q, k, v, meta, store)
            out = layer["o"](attn.reshape(-1, self.q_size))
            if "attn_out_norm" in layer:
                out = ops.add_rms_norm(out, None, layer["attn_out_norm"], eps)[1]
            h, x = ops.add_rms_norm(h, out, layer["post_norm"], eps)
            delta = self._mlp(layer, x)
            if "mlp_out_norm" in layer:
                delta = ops.add_rms_norm(delta, None, layer["mlp_out_norm"], eps)[1]
        return ops.add_rms_norm(h, delta, self.final_norm, eps)[1]

    def _qkv(self, layer: dict, x: torch.Tensor, positions: torch.Tensor,
             rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k and v [T, kv_heads, D] of normed hidden states x [T, hidden]:
        one fused projection, the per-head q / k norms if any, RoPE on q and k together."""
        spec, eps = self.spec, self.spec.norm.eps
        heads, kv_heads, dim = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
        qkv = layer["qkv"](x)
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, heads + kv_heads, dim)
        if "q_norm" in layer:  # written back into qkv: RoPE then turns q and k in place
            qk[:, :heads] = F.rms_norm(qk[:, :heads], (dim,), layer["q_norm"], eps)
            qk[:, heads:] = F.rms_norm(qk[:, heads:], (dim,), layer["k_norm"], eps)
        qk = self.ops.rope_(qk, positions, rope)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, kv_heads, dim)
        return qk[:, :heads], qk[:, heads:], v

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] in fp32 for hidden states [N, hidden]."""
        return self.lm_head(hidden).float()

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads in full, whatever its batch: every layer's
        Linears and the LM head (the embedding table is gathered by row, not read whole)."""
        linears = [layer[k] for layer in self.layers for k in ("qkv", "o", "gate_up", "down")]
        return sum(lin.nbytes for lin in linears) + self.lm_head.nbytes

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight held: the Linears (biases included), the embedding when it
        is not the LM head's, and the norms."""
        linears = [self.lm_head] + ([] if self.embed is self.lm_head else [self.embed])
        vectors = [self.final_norm]
        for layer in self.layers:
            linears += [layer[k] for k in ("qkv", "o", "gate_up", "down")]
            vectors += [layer["input_norm"], layer["post_norm"]]
        vectors += [lin.bias for lin in linears if lin.bias is not None]
        return sum(lin.nbytes for lin in linears) + sum(t.nbytes for t in vectors)

    @property
    def weight_formats(self) -> dict[str, str]:
        """Format actually held per shape class (a request the weights cannot meet is dense)."""
        layer = self.layers[0]
        held = {name: layer[name].format for name in ("qkv", "o", "gate_up", "down")}
        return {**held, "lm_head": self.lm_head.format}


def _q4_classes(weights: dict[str, torch.Tensor]) -> set[str]:
    """Shape classes whose weights the checkpoint stores as Q4 (layer 0 speaks for all)."""
    has = {p for p in ("q", "k", "v", "o") if f"model.layers.0.self_attn.{p}_proj.q4_codes"
           in weights}
    has |= {p for p in ("gate", "up", "down") if f"model.layers.0.mlp.{p}_proj.q4_codes"
            in weights}
    classes = {"qkv"} if {"q", "k", "v"} <= has else set()
    classes |= {"o"} if "o" in has else set()
    classes |= {"gate_up"} if {"gate", "up"} <= has else set()
    classes |= {"down"} if "down" in has else set()
    return classes


def _kquant_classes(weights: dict) -> set[str]:
    """Shape classes whose weights the checkpoint holds as GGUF blocks (layer 0 speaks for
    all; the LM head is the embedding when tied)."""
    stems = {"qkv": [f"self_attn.{p}_proj" for p in "qkv"], "o": ["self_attn.o_proj"],
             "gate_up": ["mlp.gate_proj", "mlp.up_proj"], "down": ["mlp.down_proj"]}
    classes = {cls for cls, names in stems.items() if all(
        isinstance(weights.get(f"model.layers.0.{n}.weight"), GGMLMatrix) for n in names)}
    head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
    return classes | ({"lm_head"} if isinstance(head, GGMLMatrix) else set())


def _held(t, dtype: torch.dtype):
    """A weight as the model holds it: GGUF blocks as they are, fp32 vectors of a GGUF's blocks
    file (its norms) as they are; other floating tensors in ``dtype``."""
    if isinstance(t, GGMLMatrix) or not t.is_floating_point() or (
            t.dim() == 1 and t.dtype == torch.float32 and dtype == torch.bfloat16):
        return t
    return t.to(dtype)


def _linear(weight, fmt: str, release, dtype: torch.dtype) -> Linear:
    """A Linear of one matrix: GGUF blocks held as they are in a ``kquant`` format (else
    dequantized to ``dtype`` for ``fmt``), a dense weight in ``fmt`` (``kquant``: dense)."""
    if isinstance(weight, GGMLMatrix):
        if fmt in KQUANT_FORMATS:
            return KQuantLinear([weight], None, fmt)
        weight = weight.dequantize(dtype)
    return Linear(weight, fmt=fmt, release=release)


def _fuse_attention(w: dict[str, torch.Tensor], prefix: str, formats: dict[str, str],
                    release, dtype: torch.dtype) -> dict:
    """One layer's fused attention Linears ``qkv`` and ``o`` (GGUF blocks held, or dequantized
    to ``dtype``); its tensors are removed from ``w`` as they are used and their pages released
    (``release``, see :class:`kvledger.model.weights.loader.MappedWeights`), so at most one
    layer exists twice (source and fused) at any time."""
    attn = prefix + "self_attn."
    return {
        "qkv": _fused_linear(w, [attn + f"{p}_proj" for p in "qkv"], formats.get("qkv", "dense"),
                             release, dtype),
        "o": _fused_linear(w, [attn + "o_proj"], formats.get("o", "dense"), release, dtype),
    }


def _fused_linear(w: dict[str, torch.Tensor], stems: list[str], fmt: str, release,
                  dtype: torch.dtype) -> Linear:
    """One Linear over the row-concatenation of several projections (or of their 4-bit forms,
    or of their GGUF blocks: held as they are in a ``kquant`` format, else dequantized to
    ``dtype``), with their biases concatenated when they have them (``{stem}.bias``).

    Only the source the format needs is read (the dense rows, or the Q4 codes for ``int4`` / ``w4a8``),
    so a memory-mapped weight cache never pages in the other one.
    """
    parts = (".q4_codes", ".q4_scale", ".q4_zero")
    biases = [w.pop(s + ".bias", None) for s in stems]
    bias = torch.cat(biases) if biases[0] is not None else None
    dense = [w.pop(s + ".weight") for s in stems]
    if any(isinstance(t, GGMLMatrix) for t in dense):
        if fmt in KQUANT_FORMATS and all(isinstance(t, GGMLMatrix) for t in dense):
            return KQuantLinear(dense, bias, fmt)
        dense = [t.dequantize(dtype) if isinstance(t, GGMLMatrix) else t for t in dense]
    out_f, in_f = sum(t.shape[0] for t in dense), dense[0].shape[1]
    has_q4 = all(s + ".q4_codes" in w for s in stems)
    q4 = [[w.pop(s + part) for s in stems] for part in parts] if has_q4 else None
    if fmt in Q4_FORMATS and q4 is not None and dense[0].dtype == torch.bfloat16 \
            and (fmt == "w4a8" or int4_shape_ok(out_f, in_f)):
        linear = Linear.from_q4(tuple(torch.cat(p) for p in q4), (out_f, in_f), bias, fmt)
    else:
        linear = Linear(torch.cat(dense).contiguous(), bias, None, fmt)
    for source in dense + [t for part in q4 or [] for t in part]:
        release(source)
    return linear
