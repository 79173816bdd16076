"""One naming of the weights for every family: Hugging Face ``LlamaForCausalLM`` names plus the
norms some families add, and the tensors (with shapes) a spec needs.

Every checkpoint is brought to these names when loaded (:func:`to_common_names`): first by its
family (``Family.weight_names``: a multimodal Gemma 3's text model, Phi-3's fused projections,
Mixtral's and gpt-oss's experts, a GGUF's split MLA ``kv_b_proj``; see each family module),
then a GGUF's stacked ``ffn_{gate,up,down}_exps`` [experts, out, in] (``gguf_tensors``) -> one
view per expert. :func:`split_rows` is the fused-projection split the families share.

:func:`tensor_shapes` lists what a model of the spec holds: per layer the q/k/v/o and gate/up/
down projections (an MoE layer: the router ``mlp.gate`` [experts, hidden], its bias when it is
the router's own rather than DeepSeek-V3's score correction, and each expert's three at
``moe_intermediate_size``), ``input_layernorm``, ``post_attention_layernorm``, Gemma's
``pre_feedforward_layernorm`` / ``post_feedforward_layernorm``, the per-head ``q_norm`` /
``k_norm`` (over the whole projection: [heads x head_dim]), the q/k/v and o biases,
gpt-oss's sink logits ``self_attn.sinks`` [heads] and expert biases when the spec has them; an MLA layer's ``q_a_proj`` / ``q_a_layernorm`` /
``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and
``o_proj``, and its MoE layers' ``mlp.shared_experts`` (with ``mlp.shared_expert_gate`` [1, hidden]
when the spec gates it); the embedding, the final norm and an
untied ``lm_head``; then the family's changes (``Family.tensor_shapes``).
"""

from __future__ import annotations

import torch

from kvledger.spec import Family, ModelSpec

_Q4_PARTS = (".q4_codes", ".q4_scale", ".q4_zero")
EXPERT_STACKS = ("mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj")
"""A layer's stacked expert projections [experts, out, in] (a GGUF's ``ffn_*_exps``), split
by :func:`to_common_names` into ``mlp.experts.{e}.*_proj``."""


def to_common_names(state: dict[str, torch.Tensor], spec: ModelSpec, family: Family) -> None:
    """Rename and split ``state`` in place into the names of :func:`tensor_shapes` (see the
    module docstring); the dict keeps its type (a memory-mapped cache stays one)."""
    family.weight_names(state, spec)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for stack in EXPERT_STACKS:
            for suffix in (".weight", ".bias"):
                tensor = state.pop(p + stack + suffix, None)
                kind = stack.rpartition(".")[2]
                for e in range(0 if tensor is None else tensor.shape[0]):
                    state[f"{p}mlp.experts.{e}.{kind}{suffix}"] = tensor[e]


def split_rows(state: dict, fused: str, parts: list[tuple[str, int]]) -> None:
    """Replace the fused projection ``fused`` (weight, bias, 4-bit parts) by row views: each
    ``(stem, rows)`` of ``parts`` takes the next ``rows`` rows; nothing when it is absent."""
    for suffix in (".weight", ".bias", *_Q4_PARTS):
        tensor = state.pop(fused + suffix, None)
        if tensor is None:
            continue
        start = 0
        for stem, rows in parts:
            state[stem + suffix] = tensor[start: start + rows]
            start += rows


def tensor_shapes(spec: ModelSpec, family: Family) -> dict[str, tuple[int, ...]]:
    """Name -> shape ([out, in] for projections) of every tensor a model of ``spec`` (of
    ``family``) holds."""
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
            wide = spec.attention.qk_norm_full_width
            shapes |= {p + "self_attn.q_norm.weight": (q if wide else d,),
                       p + "self_attn.k_norm.weight": (kv if wide else d,)}
        if spec.attention.qkv_bias:
            shapes |= {p + f"self_attn.{n}_proj.bias": (rows,)
                       for n, rows in (("q", q), ("k", kv), ("v", kv))}
        if spec.attention.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if spec.attention.sinks:
            shapes[p + "self_attn.sinks"] = (spec.num_attention_heads,)
    return family.tensor_shapes(spec, shapes)


def _mla_shapes(spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    """An MLA layer's attention tensors (``model/layers/latent_attention.py``), ``p`` its
    ``self_attn.`` prefix."""
    latent = spec.latent
    h, heads, rank = spec.hidden_size, spec.num_attention_heads, latent.kv_lora_rank
    q_dim = heads * (spec.latent.qk_nope_head_dim + spec.latent.qk_rope_head_dim)
    shapes = {p + "kv_a_proj_with_mqa.weight": (rank + spec.latent.qk_rope_head_dim, h),
              p + "kv_a_layernorm.weight": (rank,),
              p + "kv_b_proj.weight": (heads * (latent.qk_nope_head_dim + latent.v_head_dim), rank),
              p + "o_proj.weight": (h, heads * spec.latent.v_head_dim)}
    if not spec.latent.q_lora_rank:
        return shapes | {p + "q_proj.weight": (q_dim, h)}
    return shapes | {p + "q_a_proj.weight": (spec.latent.q_lora_rank, h),
                     p + "q_a_layernorm.weight": (spec.latent.q_lora_rank,),
                     p + "q_b_proj.weight": (q_dim, spec.latent.q_lora_rank)}


def _mlp_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer ``layer``'s MLP: gate / up / down, or an MoE layer's router and experts."""
    h, p = spec.hidden_size, f"model.layers.{layer}.mlp."
    if not spec.is_moe_layer(layer):
        f = spec.intermediate_size
        return {p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h),
                p + "down_proj.weight": (h, f)}
    f = spec.experts.intermediate_size
    shapes = {p + "gate.weight": (spec.experts.count, h)}
    experts = spec.experts
    if experts.router_bias and experts.topk_method != "noaux_tc":  # noaux_tc: a score correction
        shapes[p + "gate.bias"] = (spec.experts.count,)
    for e in range(spec.experts.count):
        shapes |= {f"{p}experts.{e}.gate_proj.weight": (f, h),
                   f"{p}experts.{e}.up_proj.weight": (f, h),
                   f"{p}experts.{e}.down_proj.weight": (h, f)}
        if spec.mlp.bias:
            shapes |= {f"{p}experts.{e}.gate_proj.bias": (f,),
                       f"{p}experts.{e}.up_proj.bias": (f,),
                       f"{p}experts.{e}.down_proj.bias": (h,)}
    if spec.experts.shared_count:  # one MLP of them all (DeepSeek's several)
        f = spec.experts.shared_count * spec.experts.shared_intermediate_size
        shapes |= {p + "shared_experts.gate_proj.weight": (f, h),
                   p + "shared_experts.up_proj.weight": (f, h),
                   p + "shared_experts.down_proj.weight": (h, f)}
    if spec.experts.shared_gate:  # Qwen-MoE's sigmoid gate on it
        shapes[p + "shared_expert_gate.weight"] = (1, h)
    return shapes


def is_norm(name: str) -> bool:
    """Whether tensor ``name`` is an RMSNorm weight (its identity is 1, or 0 in Gemma's form)."""
    return name.endswith("norm.weight")
