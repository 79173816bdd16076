"""Tiny models of each family built by transformers, with every feature of the real model on,
and their GGUF files as llama.cpp's ``convert_hf_to_gguf`` writes them (gguf's own writer and
gguf-py's own tensor-name map, so names come from an implementation independent of ours).

``FEATURES`` lists, per family, what its tiny config switches on; the window is ``W`` = 16 in
every sliding layer. Weights are redrawn N(0, 0.25) (norms too, so Gemma's ``1 + w`` is not 1)
so that scores reach the soft-caps and windows change what a query attends to.
"""

from __future__ import annotations

import math

import numpy as np
import torch

W = 16
SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0}
FEATURES = {
    "qwen3": ["per-head q/k RMSNorm", "explicit head_dim (32 != hidden / heads)",
              "sliding layers from max_window_layers (use_sliding_window)", "rope_theta 1e6",
              "untied head"],
    "phi3": ["fused qkv_proj and gate_up_proj", "partial_rotary_factor 0.75",
             "uniform sliding_window", "LongRoPE short factors with an attention_factor",
             "untied head"],
    "phi3-long": ["LongRoPE long factors (max length 256 > original 64)",
                  "partial_rotary_factor 0.75", "uniform sliding_window"],
    "gemma2": ["(1 + w) RMSNorm", "sandwich norms", "GeGLU (gelu_pytorch_tanh)",
               "embedding x sqrt(hidden)", "query_pre_attn_scalar 24 (head_dim 32)",
               "attention soft-cap 4", "final-logit soft-cap 6", "sliding layers (even)",
               "tied head"],
    "gemma3": ["(1 + w) RMSNorm", "sandwich norms", "GeGLU (gelu_pytorch_tanh)",
               "embedding x sqrt(hidden)", "query_pre_attn_scalar 24 (head_dim 32)",
               "per-head q/k RMSNorm", "5:1 sliding:global layers by layer_types",
               "local rope base 10,000", "global rope 1e6 with linear scaling x 8",
               "tied head"],
}
MOE_FEATURES = {
    "mixtral": ["8 experts, top 2, the softmax over the top 2", "uniform sliding_window",
                "untied head", "q/k rows permuted in its GGUF (llama architecture)"],
    "qwen3_moe": ["8 experts, top 3, norm_topk_prob", ("mlp_only_layers [2] (a dense MLP of "
                                                          "intermediate_size 96 beside experts of 48)"), "per-head q/k RMSNorm",
                  "explicit head_dim 32", "sliding window on every layer (use_sliding_window)"],
    "qwen3_moe-step2": ["decoder_sparse_step 2 (layers 1 and 3 route)",
                        "norm_topk_prob false", "6 experts, top 2"],
    "gpt_oss": ["8 experts, top 3, router bias, the softmax over the top 3 logits",
                "expert biases, gate / up in alternate columns",
                "clamped SwiGLU at swiglu_limit 1.5 (clamps reached)",
                "sink logits (nonzero), q/k/v/o biases", "sliding and full layers alternating",
                "YaRN rope (factor 4 over 64 original positions, truncate false)",
                "explicit head_dim 32", "untied head"],
}
"""The MoE families' tiny models (issue 35): top-k < experts in each."""


def _moe_config(family: str, gguf_compatible: bool):
    """The transformers config of an MoE family's tiny model (``gguf_compatible``: no window,
    which llama.cpp's converters do not write for these architectures; Qwen3-MoE's top-k
    renormalised, as llama.cpp's qwen3moe graph always does, and every layer routed: its
    qwen3moe tensors have no dense MLP)."""
    import transformers as tf

    window = {} if gguf_compatible else {"sliding_window": W}
    if family == "mixtral":
        return tf.MixtralConfig(**SHAPE, num_hidden_layers=3, num_local_experts=8,
                                num_experts_per_tok=2, max_position_embeddings=256,
                                rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                **(window or {"sliding_window": None}))
    if family == "gpt_oss":  # a GGUF: llama.cpp's constant clamp and its YaRN truncation
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": gguf_compatible,
                "original_max_position_embeddings": 64}
        return tf.GptOssConfig(**SHAPE, num_hidden_layers=4, head_dim=32, num_local_experts=8,
                               num_experts_per_tok=3, swiglu_limit=7.0 if gguf_compatible else 1.5,
                               max_position_embeddings=256, rope_parameters=yarn,
                               rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=W)
    step2 = family == "qwen3_moe-step2"
    return tf.Qwen3MoeConfig(**SHAPE, num_hidden_layers=4, head_dim=32, moe_intermediate_size=48,
                             num_experts=6 if step2 else 8, num_experts_per_tok=2 if step2 else 3,
                             norm_topk_prob=not step2 or gguf_compatible,
                             decoder_sparse_step=2 if step2 else 1,
                             mlp_only_layers=[] if step2 or gguf_compatible else [2],
                             use_sliding_window=not gguf_compatible, max_position_embeddings=256,
                             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             **window)


def _config(family: str, gguf_compatible: bool = False):
    """The transformers config of ``family``'s tiny model (``gguf_compatible``: Gemma's
    query_pre_attn_scalar = head_dim, the value llama.cpp assumes for a GGUF, and no Qwen3
    window, which its converter does not write)."""
    import transformers as tf

    if family in MOE_FEATURES:
        return _moe_config(family, gguf_compatible)
    scalar = 32 if gguf_compatible else 24
    if family == "qwen3":
        # llama.cpp's Qwen3 converter writes no window (real Qwen3 has none): none in a GGUF
        return tf.Qwen3Config(**SHAPE, num_hidden_layers=3, head_dim=32, rope_theta=1e6,
                              max_position_embeddings=256, use_sliding_window=not gguf_compatible,
                              sliding_window=W, max_window_layers=1, rms_norm_eps=1e-6,
                              tie_word_embeddings=False)
    if family in ("phi3", "phi3-long"):
        original, longest = (128, 128) if family == "phi3" else (64, 256)
        pairs = int(16 * 0.75) // 2
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": original,
                   "short_factor": [1.0 + 0.3 * i for i in range(pairs)],
                   "long_factor": [2.0 + 1.5 * i for i in range(pairs)]}
        if family == "phi3":
            scaling["attention_factor"] = 1.3
        return tf.Phi3Config(**SHAPE, num_hidden_layers=3, max_position_embeddings=longest,
                             original_max_position_embeddings=original, rope_scaling=scaling,
                             partial_rotary_factor=0.75, sliding_window=W, rms_norm_eps=1e-5,
                             tie_word_embeddings=False)
    if family == "gemma2":
        return tf.Gemma2Config(**SHAPE, num_hidden_layers=4, head_dim=32,
                               max_position_embeddings=256, query_pre_attn_scalar=scalar,
                               attn_logit_softcapping=4.0, final_logit_softcapping=6.0,
                               sliding_window=W, rms_norm_eps=1e-6)
    if family == "gemma3":
        kinds = ["sliding_attention"] * 5 + ["full_attention"]
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
        return tf.Gemma3TextConfig(**SHAPE, num_hidden_layers=6, head_dim=32,
                                   max_position_embeddings=256, query_pre_attn_scalar=scalar,
                                   sliding_window=W, layer_types=kinds, rope_parameters=rope,
                                   rms_norm_eps=1e-6)
    raise ValueError(family)


def make_tiny(family: str, folder, seed: int = 0, gguf_compatible: bool = False):
    """Save ``family``'s tiny random model (safetensors) in ``folder``; return it (fp32,
    eval)."""
    return save_tiny(_config(family, gguf_compatible), folder, seed)


def save_tiny(config, folder, seed: int = 0):
    """Save the causal LM of the transformers ``config``, its weights drawn with ``seed``
    (:func:`redraw`), in ``folder`` (safetensors); return it (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = redraw(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), seed)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def redraw(model, seed: int):
    """``model`` with every parameter, norms too, drawn anew from N(0, 0.25) with ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.25)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits [vocab] after ``ids``, recomputing the whole sequence (no cache)."""
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits[0, -1]


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens after ``prompt``, each step over the whole sequence."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(hf_logits(model, ids).argmax()))
    return ids[len(prompt):]


# ---- GGUF, as convert_hf_to_gguf writes each architecture ---------------------------------

GGUF_ARCH = {"qwen3": "qwen3", "phi3": "phi3", "phi3-long": "phi3", "gemma2": "gemma2",
             "gemma3": "gemma3", "mixtral": "llama", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}


def add_metadata(w, arch: str, meta: dict) -> None:
    """Each ``meta`` entry as the key ``{arch}.{key}`` of the GGUF writer ``w``, in the type of
    its value (string, float32, array, else uint32)."""
    for key, value in meta.items():
        full = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, list):
            w.add_array(full, value)
        else:
            w.add_uint32(full, value)


def write_gguf(family: str, model, path) -> None:
    """Write ``model`` (a tiny model of ``family``) as a GGUF file at ``path``: gguf-py's
    tensor names for the architecture, F32 tensors, Gemma's norms stored as ``1 + w``, Phi-3's
    fused projections kept and its LongRoPE factors as tensors, an MoE layer's experts stacked
    per projection (``ffn_{gate,up,down}_exps`` [experts, out, in]; Mixtral's q / k rows
    permuted as ``LlamaModel.permute`` does), the metadata keys the converter writes
    (``conversion/{qwen,phi,gemma,llama}.py``, ``TextModel.set_gguf_parameters``)."""
    import gguf

    arch = GGUF_ARCH[family]
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")],
                                     cfg.num_hidden_layers)
    add_metadata(w, arch, _metadata(family, cfg))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, _, kind = hf.rpartition(".")
        if kind == "sinks":  # the converter names them attn_sinks.weight
            stem, kind = hf, "weight"
        data = tensor.float().numpy().astype(np.float32)
        if arch.startswith("gemma") and hf.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if ".experts." in hf or hf.endswith("mlp.gate.weight"):
            split = _gpt_oss_expert_tensors if family == "gpt_oss" else _expert_tensors
            for name, part in split(hf, data):
                w.add_tensor(name, part)
            continue
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            heads = cfg.num_attention_heads if "q_proj" in stem else cfg.num_key_value_heads
            data = _permute(data, heads)
        w.add_tensor(f"{names.get_name(stem)}.{kind}", data)
    scaling = cfg.rope_parameters if arch == "phi3" else {}
    if scaling.get("long_factor"):
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _expert_tensors(hf: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """GGUF tensors of a transformers MoE parameter: the router ``mlp.gate`` ->
    ``ffn_gate_inp``; the stacked ``experts.gate_up_proj`` [experts, 2f, hidden] (gate rows
    first, as ``MixtralExperts`` chunks them) -> ``ffn_gate_exps`` and ``ffn_up_exps``;
    ``experts.down_proj`` -> ``ffn_down_exps``."""
    layer = hf.split(".")[2]
    if hf.endswith("mlp.gate.weight"):
        return [(f"blk.{layer}.ffn_gate_inp.weight", data)]
    if hf.endswith("gate_up_proj"):
        f = data.shape[1] // 2
        return [(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(data[:, :f])),
                (f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(data[:, f:]))]
    return [(f"blk.{layer}.ffn_down_exps.weight", data)]


def _gpt_oss_expert_tensors(hf: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """GGUF tensors of a gpt-oss expert parameter as ``conversion/gpt_oss.py`` writes an
    unquantized one: ``gate_up_proj`` [experts, hidden, 2f] transposed and its alternate rows
    split (even: gate, odd: up), the biases likewise; ``down_proj`` transposed."""
    layer = hf.split(".")[2]
    blk = f"blk.{layer}.ffn_"
    if hf.endswith("gate_up_proj"):
        rows = data.transpose(0, 2, 1)
        return [(blk + "gate_exps.weight", np.ascontiguousarray(rows[:, 0::2])),
                (blk + "up_exps.weight", np.ascontiguousarray(rows[:, 1::2]))]
    if hf.endswith("gate_up_proj_bias"):
        return [(blk + "gate_exps.bias", np.ascontiguousarray(data[:, 0::2])),
                (blk + "up_exps.bias", np.ascontiguousarray(data[:, 1::2]))]
    if hf.endswith("down_proj"):
        return [(blk + "down_exps.weight", np.ascontiguousarray(data.transpose(0, 2, 1)))]
    return [(blk + "down_exps.bias", data)]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rotate-half rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _metadata(family: str, cfg) -> dict:
    meta = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads,
            "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps)}
    rope = cfg.rope_parameters
    if family == "qwen3":
        meta.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                     "rope.freq_base": float(rope["rope_theta"])})
    elif family == "mixtral":
        meta.update({"rope.freq_base": float(rope["rope_theta"]),
                     "rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
                     "expert_count": cfg.num_local_experts,
                     "expert_used_count": cfg.num_experts_per_tok})
    elif family == "gpt_oss":
        meta.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                     "rope.freq_base": float(rope["rope_theta"]),
                     "expert_count": cfg.num_local_experts,
                     "expert_used_count": cfg.num_experts_per_tok,
                     "expert_feed_forward_length": cfg.intermediate_size,
                     "attention.sliding_window": cfg.sliding_window,
                     "rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                     "rope.scaling.original_context_length":
                         rope["original_max_position_embeddings"],
                     "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
                     "rope.scaling.yarn_beta_slow": float(rope["beta_slow"])})
    elif family == "qwen3_moe":
        meta.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                     "rope.freq_base": float(rope["rope_theta"]),
                     "expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
                     "expert_feed_forward_length": cfg.moe_intermediate_size})
    elif family.startswith("phi3"):
        original, factor = rope["original_max_position_embeddings"], None
        scale = cfg.max_position_embeddings / original
        factor = rope.get("attention_factor") or (
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        meta.update({"rope.scaling.original_context_length": original,
                     "rope.dimension_count": int(0.75 * cfg.hidden_size) // cfg.num_attention_heads,
                     "rope.freq_base": float(rope["rope_theta"]),
                     "attention.sliding_window": cfg.sliding_window,
                     "rope.scaling.attn_factor": float(factor)})
    elif family == "gemma2":
        meta.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                     "rope.freq_base": float(rope["rope_theta"]),
                     "attn_logit_softcapping": float(cfg.attn_logit_softcapping),
                     "final_logit_softcapping": float(cfg.final_logit_softcapping),
                     "attention.sliding_window": cfg.sliding_window})
    elif family == "gemma3":
        meta.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                     "rope.freq_base": float(rope["full_attention"]["rope_theta"]),
                     "rope.freq_base_swa": float(rope["sliding_attention"]["rope_theta"]),
                     "rope.scaling.type": "linear",
                     "rope.scaling.factor": float(rope["full_attention"]["factor"]),
                     "attention.sliding_window": cfg.sliding_window})
    return meta
