"""GGUF tensors -> a Hugging Face-named fp32 state dict.

Each tensor of a GGUF (an architecture a family of ``kvledger.model.families`` reads) is
dequantized with ``gguf.quants.dequantize`` (numpy) and renamed to its Hugging Face parameter
name as llama.cpp's ``convert_hf_to_gguf`` named it (gguf-py's ``tensor_mapping``): the Llama
names, an MoE layer's stacked ``ffn_*_exps`` [experts, out, in] (Mixtral's ``w1`` / ``w3`` /
``w2`` as gate / up / down) beside its router ``ffn_gate_inp`` (:mod:`.names` splits those),
and the names the family adds (``Family.gguf_tensors``). A family whose converter stores every
norm weight as ``1 + w`` (``Family.gguf_norm_plus_one``, Gemma) has 1 subtracted back, exactly
for weights >= 0.5. Phi-3's ``rope_factors_long`` / ``_short`` belong to the spec
(``rope_scaling``), not to the weights. GGUF stores dimensions
innermost-first (``ne0`` = columns), so a dequantized matrix already comes out as ``[out, in]``
like ``nn.Linear.weight``; the embedding comes out as ``[vocab, hidden]``.

Rotary un-permutation: llama.cpp's ``convert_hf_to_gguf`` (``LlamaModel``, used for llama and
mistral) reorders the rows of ``attn_q`` / ``attn_k`` within each head from the HF "rotate half"
layout (first half of a head's dims, then second half) to interleaved pairs (GPT-J style, which
is what ggml's normal RoPE rotates)::

    permute(w, n_head) = w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2).reshape(w.shape)

with ``d = rows / n_head`` (``n_head = n_kv_heads`` for K). :func:`unpermute_rotary` is its
inverse. Qwen2/Qwen3, Phi-3 and Gemma 2/3 GGUFs use NEOX RoPE (the HF layout; llama.cpp's
``llama_model_rope_type``) and are not permuted.

A K-quant file (:func:`is_kquant_file`) is read by :func:`gguf_block_state` instead: each
matrix of :data:`kvledger.model.kquant.BLOCK_TYPES` is kept as the file's blocks
(:class:`~kvledger.model.kquant.GGMLMatrix`, attn_q / attn_k rows un-permuted as whole rows of
blocks), F32 vectors (the norms) stay fp32 as stored, and only what is left (a matrix of another
type) is dequantized, so the bytes held are the file's.

Errors: a tensor type outside :data:`SUPPORTED_TYPES` -> UnsupportedModelError naming the type and
the tensor; a tensor name the architecture does not have -> UnsupportedModelError.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from kvledger.errors import UnsupportedModelError
from kvledger.model.kquant import BLOCK_TYPES, KQUANT_TYPES, GGMLMatrix
from kvledger.model.q4 import Q4_TYPES, q4_parts
from kvledger.spec import Family, ModelSpec

# Types we dequantize (all through gguf.quants; float types are stored as-is).
SUPPORTED_TYPES = frozenset(
    ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
    + ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "token_embd_norm.weight": "model.embedding_norm.weight",  # LFM2's final norm
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
SPEC_TENSORS = frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})
"""Tensors the spec reader takes (LongRoPE's factors), not weights."""
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?$")
"""A block tensor: its layer, its part (LFM2's ``shortconv.conv`` holds a dot) and its kind;
a Mamba-2 layer's ``ssm_a`` / ``ssm_d`` have no kind."""


def hf_name(gguf_name: str, family: Family) -> str:
    """Hugging Face parameter name of a GGUF tensor name of a family's file
    (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``).

    Raises:
        UnsupportedModelError: the name is not part of the family's decoder.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_BLOCK_NAMES, **family.gguf_tensors}
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in names:
        raise UnsupportedModelError(
            f"unsupported GGUF tensor {gguf_name!r} (not a weight of a {family.name} decoder)"
        )
    layer, part, kind = m.groups()
    return f"model.layers.{layer}.{names[part]}" + (f".{kind}" if kind else "")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K ``permute``: interleaved rotary pairs -> HF rotate-half rows.

    Args:
        w: ``[n_head * head_dim, ...]`` rows of attn_q (n_head = heads) or attn_k (kv heads);
           a weight ``[rows, hidden]`` or a bias ``[rows]``.
    Returns:
        Array of the same shape with each head's rows ``(0, 2, 4, ..., 1, 3, 5, ...)`` order.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """Dequantize one ``gguf.ReaderTensor`` to float32, shaped ``[ne1, ne0]`` (rows, columns).

    Raises:
        UnsupportedModelError: the tensor type is not in SUPPORTED_TYPES.
    """
    from gguf.quants import dequantize as gguf_dequantize

    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"unsupported GGUF tensor type {type_name} for tensor {tensor.name!r} "
            f"(supported: {', '.join(sorted(SUPPORTED_TYPES))})"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return gguf_dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)


def _names(tensor, family: Family) -> tuple[str, str] | None:
    """(Hugging Face name, GGUF part such as ``attn_q``; "" outside the layers) of a tensor of
    a family's file; None for a tensor the spec reader takes (:data:`SPEC_TENSORS`).

    Raises:
        UnsupportedModelError: llama3 RoPE factors (``rope_freqs``, not implemented) or a name
            the architecture does not have.
    """
    if tensor.name == "rope_freqs.weight":
        raise UnsupportedModelError(
            "GGUF tensor 'rope_freqs.weight' (llama3 RoPE frequency factors) is not supported"
        )
    if tensor.name in SPEC_TENSORS:
        return None
    part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
    return hf_name(tensor.name, family), part


def is_kquant_file(reader, family: Family) -> bool:
    """Whether the open GGUF holds a K-quant matrix (Q4_K, Q5_K or Q6_K) of a family whose
    blocks are held as stored (``Family.gguf_kquant_blocks``: checked against their
    dequantized file; the other families' K-quant files are dequantized at load)."""
    return family.gguf_kquant_blocks and any(
        t.tensor_type.name in KQUANT_TYPES for t in reader.tensors)


def _permuted(spec: ModelSpec, family: Family) -> bool:
    """Whether the file's attn_q / attn_k rows were permuted for ggml's RoPE."""
    return spec.extra.get("gguf_architecture", spec.model_type) in family.gguf_rope_permuted


def gguf_block_state(reader, path, spec: ModelSpec, family: Family, dtype: torch.dtype
                     ) -> dict[str, torch.Tensor | GGMLMatrix]:
    """The tensors of an open K-quant GGUF under Hugging Face names: matrices of
    :data:`~kvledger.model.kquant.BLOCK_TYPES` as :class:`~kvledger.model.kquant.GGMLMatrix`
    (read from ``path`` into memory, never through a memory map, so no page of the file stays
    resident beside them), F32 vectors in fp32, the rest dequantized to ``dtype``.

    Raises:
        UnsupportedModelError: as :func:`gguf_state_dict`.
    """
    permuted = _permuted(spec, family)
    heads = {"attn_q": spec.num_attention_heads, "attn_k": spec.num_kv_heads}
    state: dict[str, torch.Tensor | GGMLMatrix] = {}
    with open(path, "rb") as f:
        for tensor in reader.tensors:
            names, type_name = _names(tensor, family), tensor.tensor_type.name
            if names is None:
                continue
            name, part = names
            if type_name in BLOCK_TYPES and len(tensor.shape) == 2:
                rows = int(tensor.shape[1])
                data = torch.empty(rows, int(tensor.n_bytes) // rows, dtype=torch.uint8)
                f.seek(int(tensor.data_offset))
                f.readinto(data.numpy())
                if permuted and part in heads:
                    data = torch.from_numpy(np.ascontiguousarray(
                        unpermute_rotary(data.numpy(), heads[part])))
                state[name] = GGMLMatrix(type_name, data, int(tensor.shape[0]))
                continue
            array = dequantize(tensor)
            if permuted and part in heads:
                array = unpermute_rotary(array, heads[part])
            held = torch.float32 if type_name == "F32" and array.ndim == 1 else dtype
            state[name] = torch.from_numpy(np.ascontiguousarray(array)).to(held)
    return state


def gguf_state_dict(reader, spec: ModelSpec, family: Family) -> dict[str, torch.Tensor]:
    """Dequantize every tensor of an open GGUF into HF-named contiguous fp32 torch tensors.

    Q4_0 / Q4_1 matrices also keep their packed form for the int4 decode kernel, as
    ``<stem>.q4_codes`` (uint8 [out, in]), ``<stem>.q4_scale`` and ``<stem>.q4_zero``
    (float32 [out, in / 32]); see :mod:`kvledger.model.q4`.

    Args:
        reader: a ``gguf.GGUFReader`` of the file ``spec`` was read from.
        spec: its ModelSpec (head counts for the rotary un-permutation).
        family: the family of its architecture (its tensor names, permutation, norm form).
    Raises:
        UnsupportedModelError: unsupported tensor type or tensor name, or llama3 RoPE factors
            stored as a ``rope_freqs`` tensor (not implemented).
    """
    permuted = _permuted(spec, family)
    heads = {"attn_q": spec.num_attention_heads, "attn_k": spec.num_kv_heads}
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        names = _names(tensor, family)
        if names is None:
            continue
        name, part = names
        arrays = {name: dequantize(tensor)}
        if family.gguf_norm_plus_one and name.endswith("norm.weight"):
            arrays[name] -= 1.0
        if tensor.tensor_type.name in Q4_TYPES and name.endswith(".weight") \
                and arrays[name].ndim == 2:
            rows = arrays[name].shape[0]
            stem = name.removesuffix(".weight")
            q, scale, zero = q4_parts(tensor.data, tensor.tensor_type.name, rows)
            arrays.update({stem + ".q4_codes": q, stem + ".q4_scale": scale,
                           stem + ".q4_zero": zero})
        for key, array in arrays.items():
            if permuted and part in heads:
                array = unpermute_rotary(array, heads[part])
            state[key] = torch.from_numpy(np.ascontiguousarray(array))
    return state
