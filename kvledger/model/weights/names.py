"""One naming of the weights for every family: Hugging Face ``LlamaForCausalLM`` names plus the
norms some families add, and the tensors (with shapes) a spec needs.

Every checkpoint is brought to these names when loaded (:func:`to_llama_names`):

- a multimodal Gemma 3 folder's text model, ``language_model.model.*`` (transformers 4) or
  ``model.language_model.*`` (transformers 5) -> ``model.*``, ``language_model.lm_head`` ->
  ``lm_head``; the vision tower and the projector are dropped;
- Phi-3's fused ``self_attn.qkv_proj`` (q, k, v rows) and ``mlp.gate_up_proj`` (gate rows,
  then up, as ``Phi3MLP`` chunks them) -> the separate projections, as row views (a GGUF's
  4-bit parts are split with their rows);
- Mixtral's ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.w1`` / ``w3`` /
  ``w2`` -> Qwen-MoE's ``mlp.gate`` and ``mlp.experts.{e}.gate_proj`` / ``up_proj`` /
  ``down_proj`` (``MixtralBlockSparseTop2MLP``: ``w2(silu(w1 x) * w3 x)``); a GGUF's stacked
  ``ffn_{gate,up,down}_exps`` [experts, out, in] (``gguf_tensors``) -> one view per expert;
- gpt-oss's ``mlp.router`` -> ``mlp.gate``, and its stacked ``mlp.experts.gate_up_proj``
  [experts, hidden, 2f] (used as ``x @ W``, gate and up in alternate columns) and
  ``down_proj`` [experts, f, hidden] with their ``*_bias`` -> per expert ``gate_proj`` /
  ``up_proj`` / ``down_proj`` [out, in] views (``GptOssExperts``); MXFP4 ``*_blocks`` /
  ``*_scales`` are dequantized first (:mod:`.mxfp4`).
- a GGUF's MLA ``k_b_proj`` [heads, L, nope] and ``v_b_proj`` [heads, v, L] (llama.cpp's
  converter splits ``kv_b_proj`` so) -> ``kv_b_proj`` [heads * (nope + v), L].

:func:`tensor_shapes` lists what a model of the spec holds: per layer the q/k/v/o and gate/up/
down projections (an MoE layer: the router ``mlp.gate`` [experts, hidden] and each expert's
three at ``moe_intermediate_size``), ``input_layernorm``, ``post_attention_layernorm``, Gemma's
``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``, the per-head ``q_norm`` /
``k_norm``, the q/k/v and o biases, gpt-oss's sink logits ``self_attn.sinks`` [heads], router
bias and expert biases when the spec has them; an MLA layer's ``q_a_proj`` /
``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
``kv_b_proj`` and ``o_proj``, and its MoE layers' ``mlp.shared_experts``; the embedding, the
final norm and an untied ``lm_head``.
"""

from __future__ import annotations

import torch

from kvledger.model.weights.mxfp4 import dequantize_experts
from kvledger.spec import ModelSpec

_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
             "model.multi_modal_projector.")
_Q4_PARTS = (".q4_codes", ".q4_scale", ".q4_zero")
_MIXTRAL = {"block_sparse_moe.gate.": "mlp.gate.", "w1.": "gate_proj.", "w3.": "up_proj.",
            "w2.": "down_proj."}
EXPERT_STACKS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
"""A layer's stacked expert projections [experts, out, in] (a GGUF's ``ffn_*_exps``), split
by :func:`to_llama_names` into ``mlp.experts.{e}.*_proj``."""


def to_llama_names(state: dict[str, torch.Tensor], spec: ModelSpec) -> None:
    """Rename and split ``state`` in place into the names of :func:`tensor_shapes` (see the
    module docstring); the dict keeps its type (a memory-mapped cache stays one)."""
    for name in list(state):
        if name.startswith(_NOT_TEXT):
            del state[name]
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                state[new + name[len(old):]] = state.pop(name)
                break
        if ".block_sparse_moe." in name:
            state[_mixtral_name(name)] = state.pop(name)
    d, q, kv = spec.head_dim, spec.num_attention_heads, spec.num_kv_heads
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        _split(state, p + "self_attn.qkv_proj", [(p + f"self_attn.{n}_proj", rows) for n, rows
                                                 in (("q", q * d), ("k", kv * d), ("v", kv * d))])
        k_b = state.pop(p + "self_attn.k_b_proj.weight", None)
        if k_b is not None:
            v_b = state.pop(p + "self_attn.v_b_proj.weight")
            state[p + "self_attn.kv_b_proj.weight"] = torch.cat(
                (k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1]).contiguous()
        f = spec.intermediate_size
        _split(state, p + "mlp.gate_up_proj", [(p + "mlp.gate_proj", f), (p + "mlp.up_proj", f)])
        _gpt_oss_names(state, p)
        for stack in EXPERT_STACKS:
            for suffix in (".weight", ".bias"):
                tensor = state.pop(p + stack + suffix, None)
                kind = stack.rpartition(".")[2]
                for e in range(0 if tensor is None else tensor.shape[0]):
                    state[f"{p}mlp.experts.{e}.{kind}{suffix}"] = tensor[e]


def _gpt_oss_names(state: dict, p: str) -> None:
    """gpt-oss's sink logits (a GGUF's ``attn_sinks.weight``), router and stacked experts of
    layer ``p`` -> the names of :func:`tensor_shapes` (module docstring); nothing when the
    layer has none."""
    if p + "self_attn.sinks.weight" in state:
        state[p + "self_attn.sinks"] = state.pop(p + "self_attn.sinks.weight")
    mlp = p + "mlp."
    for suffix in (".weight", ".bias"):
        if mlp + "router" + suffix in state:
            state[mlp + "gate" + suffix] = state.pop(mlp + "router" + suffix)
    dequantize_experts(state, mlp + "experts.")
    gate_up = state.pop(mlp + "experts.gate_up_proj", None)
    if gate_up is None:
        return
    down, bias = state.pop(mlp + "experts.down_proj"), state.pop(mlp + "experts.gate_up_proj_bias")
    down_bias = state.pop(mlp + "experts.down_proj_bias")
    for e in range(gate_up.shape[0]):
        stem = f"{mlp}experts.{e}."
        state |= {stem + "gate_proj.weight": gate_up[e, :, 0::2].T,
                  stem + "up_proj.weight": gate_up[e, :, 1::2].T,
                  stem + "gate_proj.bias": bias[e, 0::2], stem + "up_proj.bias": bias[e, 1::2],
                  stem + "down_proj.weight": down[e].T, stem + "down_proj.bias": down_bias[e]}


def _mixtral_name(name: str) -> str:
    """A Mixtral expert or router tensor's Qwen-MoE name (module docstring)."""
    stem, _, rest = name.partition("block_sparse_moe.")
    if rest.startswith("gate."):
        return stem + "mlp." + rest
    expert, _, proj = rest.removeprefix("experts.").partition(".")
    return f"{stem}mlp.experts.{expert}.{_MIXTRAL[proj.partition('.')[0] + '.']}" \
        f"{proj.partition('.')[2]}"


def _split(state: dict, fused: str, parts: list[tuple[str, int]]) -> None:
    """Replace the fused projection ``fused`` (weight, bias, 4-bit parts) by row views."""
    for suffix in (".weight", ".bias", *_Q4_PARTS):
        tensor = state.pop(fused + suffix, None)
        if tensor is None:
            continue
        start = 0
        for stem, rows in parts:
            state[stem + suffix] = tensor[start: start + rows]
            start += rows


def tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Name -> shape ([out, in] for projections) of every tensor a model of ``spec`` holds."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    norms = ["input_layernorm", "post_attention_layernorm"]
    if spec.norm.per_layer == 4:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {f"{p}{n}.weight": (h,) for n in norms}
        if spec.latent is not None:
            shapes |= _mla_shapes(spec, p + "self_attn.")
        else:
            shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight":
                       (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, q)}
        shapes |= _mlp_shapes(spec, i)
        if spec.attention.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if spec.attention.qkv_bias:
            shapes |= {p + f"self_attn.{n}_proj.bias": (rows,)
                       for n, rows in (("q", q), ("k", kv), ("v", kv))}
        if spec.attention.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if spec.attention.sinks:
            shapes[p + "self_attn.sinks"] = (spec.num_attention_heads,)
    return shapes


def _mla_shapes(spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    """An MLA layer's attention tensors (``model/mla.py``), ``p`` its ``self_attn.`` prefix."""
    mla, h, heads = spec.latent, spec.hidden_size, spec.num_attention_heads
    rank = mla.kv_lora_rank
    q_dim = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    shapes = {p + "kv_a_proj_with_mqa.weight": (rank + mla.qk_rope_head_dim, h),
              p + "kv_a_layernorm.weight": (rank,),
              p + "kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), rank),
              p + "o_proj.weight": (h, heads * mla.v_head_dim)}
    if not mla.q_lora_rank:
        return shapes | {p + "q_proj.weight": (q_dim, h)}
    return shapes | {p + "q_a_proj.weight": (mla.q_lora_rank, h),
                     p + "q_a_layernorm.weight": (mla.q_lora_rank,),
                     p + "q_b_proj.weight": (q_dim, mla.q_lora_rank)}


def _mlp_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer ``layer``'s MLP: gate / up / down, or an MoE layer's router and experts."""
    h, p = spec.hidden_size, f"model.layers.{layer}.mlp."
    if not spec.is_moe_layer(layer):
        f = spec.intermediate_size
        return {p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h),
                p + "down_proj.weight": (h, f)}
    experts = spec.experts
    f = experts.intermediate_size
    shapes = {p + "gate.weight": (experts.count, h)}
    if experts.router_bias and spec.model_type == "gpt_oss":  # DeepSeek's is a score correction
        shapes[p + "gate.bias"] = (experts.count,)
    for e in range(experts.count):
        shapes |= {f"{p}experts.{e}.gate_proj.weight": (f, h),
                   f"{p}experts.{e}.up_proj.weight": (f, h),
                   f"{p}experts.{e}.down_proj.weight": (h, f)}
        if spec.mlp.bias:
            shapes |= {f"{p}experts.{e}.gate_proj.bias": (f,),
                       f"{p}experts.{e}.up_proj.bias": (f,),
                       f"{p}experts.{e}.down_proj.bias": (h,)}
    if experts.shared_count and not experts.shared_gate:  # DeepSeek's, one MLP of all
        f = experts.shared_count * experts.shared_intermediate_size
        shapes |= {p + "shared_experts.gate_proj.weight": (f, h),
                   p + "shared_experts.up_proj.weight": (f, h),
                   p + "shared_experts.down_proj.weight": (h, f)}
    return shapes


def is_norm(name: str) -> bool:
    """Whether tensor ``name`` is an RMSNorm weight (its identity is 1, or 0 in Gemma's form)."""
    return name.endswith("norm.weight")
