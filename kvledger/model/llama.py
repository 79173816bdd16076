"""Llama-family decoder forward pass in plain PyTorch, reading and writing the paged KV cache.

Architecture (Touvron et al., "LLaMA", arXiv:2302.13971; GQA: Ainslie et al., arXiv:2305.13245):
token embedding -> N x [RMSNorm -> attention (Q, K, V projections, RoPE on Q and K, GQA) ->
residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm -> LM head (tied or untied).

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

from kvledger.device.cpu.device import CPU
from kvledger.engine.attention import AttentionBackend, AttentionMetadata, make_backend
from kvledger.engine.kv.store import KVStore
from kvledger.model.kquant import GGMLMatrix, KQuantLinear
from kvledger.model.linear import KQUANT_FORMATS, Q4_FORMATS, Linear, int4_shape_ok
from kvledger.model.rope import RotaryEmbedding
from kvledger.spec import ModelSpec, check_runnable


class LlamaModel:
    """Weights and forward pass of a Llama-family causal LM.

    Args:
        spec: the architecture.
        weights: Hugging Face Llama parameter names -> tensors ([out, in] for projections).
        dtype: compute dtype (torch.float32 or torch.bfloat16).
        attention: an attention backend or its name (see :mod:`kvledger.engine.attention`);
            None takes ``$KVLEDGER_ATTENTION``, else the kernel choice of the probe.
        formats: weight format per shape class (``{"qkv": "int4", "lm_head": "int8", ...}``);
            classes left out are dense; None asks the kernel probe. Ignored in fp32.

    Raises:
        UnsupportedModelError: a spec the forward would not compute exactly
            (:func:`kvledger.spec.check_runnable`).
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 attention: AttentionBackend | str | None = None,
                 formats: dict[str, str] | None = None):
        check_runnable(spec)
        self.spec, self.dtype = spec, dtype
        if not isinstance(attention, AttentionBackend):
            attention = make_backend(attention or CPU.attention_backend(spec))
        self.attention = attention
        self.ops = CPU.fused_ops(spec)
        gemm = {}
        if dtype != torch.bfloat16:
            formats = {}
        elif formats is None:
            formats = CPU.weight_formats(spec, _q4_classes(weights), _kquant_classes(weights))
            gemm = CPU.gemm_paths(spec, formats)
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
        self.final_norm = w.pop("model.norm.weight").clone()  # clones: no view of the cache
        self.layers = []
        for i in range(spec.num_layers):
            self.layers.append(_fuse_layer(w, f"model.layers.{i}.", self.formats, release,
                                           dtype))
            for cls, choice in gemm.items():
                if choice is not None and cls in self.layers[-1]:
                    self.layers[-1][cls].use_gemm(*choice)
        self.rope = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings,
                                    spec.rope_theta, spec.rope_scaling, dtype)
        self.q_size = spec.num_attention_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, store: KVStore | None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for token ids [T] at positions [T].

        Each residual add is fused with the RMSNorm after it (``h`` is updated in place).
        """
        spec, ops, eps = self.spec, self.ops, self.spec.rms_norm_eps
        h = self.embed.rows(input_ids, self.dtype)
        heads, kv_heads, dim = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
        delta = None
        for i, layer in enumerate(self.layers):
            h, x = ops.add_rms_norm(h, delta, layer["input_norm"], eps)
            qkv = layer["qkv"](x)
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, heads + kv_heads, dim)
            qk = ops.rope_(qk, positions, self.rope)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, self.q_size + self.kv_size:].view(-1, kv_heads, dim)
            attn = self.attention(i, q, k, v, meta, store)
            h, x = ops.add_rms_norm(h, layer["o"](attn.reshape(-1, self.q_size)),
                                    layer["post_norm"], eps)
            delta = layer["down"](ops.silu_mul(layer["gate_up"](x)))
        return ops.add_rms_norm(h, delta, self.final_norm, eps)[1]

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


def _fuse_layer(w: dict[str, torch.Tensor], prefix: str, formats: dict[str, str],
                release, dtype: torch.dtype) -> dict:
    """One layer's norms and fused Linears; its tensors are removed from ``w`` as they are
    used and their pages released (``release``, see :class:`kvledger.model.weights.loader.
    MappedWeights`), so at most one layer exists twice (source and fused) at any time."""
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    qkv = [attn + f"{p}_proj" for p in "qkv"]
    bias = [w.pop(stem + ".bias", None) for stem in qkv]
    return {
        "input_norm": w.pop(prefix + "input_layernorm.weight").clone(),
        "post_norm": w.pop(prefix + "post_attention_layernorm.weight").clone(),
        "qkv": _fused_linear(w, qkv, formats.get("qkv", "dense"), release, dtype,
                             torch.cat(bias) if bias[0] is not None else None),
        "o": _fused_linear(w, [attn + "o_proj"], formats.get("o", "dense"), release, dtype),
        "gate_up": _fused_linear(w, [mlp + "gate_proj", mlp + "up_proj"],
                                 formats.get("gate_up", "dense"), release, dtype),
        "down": _fused_linear(w, [mlp + "down_proj"], formats.get("down", "dense"), release,
                              dtype),
    }


def _fused_linear(w: dict[str, torch.Tensor], stems: list[str], fmt: str, release,
                  dtype: torch.dtype, bias: torch.Tensor | None = None) -> Linear:
    """One Linear over the row-concatenation of several projections (or of their 4-bit forms,
    or of their GGUF blocks: held as they are in a ``kquant`` format, else dequantized to
    ``dtype``).

    Only the source the format needs is read (the dense rows, or the Q4 codes for ``int4`` / ``w4a8``),
    so a memory-mapped weight cache never pages in the other one.
    """
    parts = (".q4_codes", ".q4_scale", ".q4_zero")
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
