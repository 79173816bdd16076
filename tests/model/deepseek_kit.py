"""Tiny random DeepSeek-V2 models built by transformers (``DeepseekV2ForCausalLM``), in the two
variants of issue 36, with every feature of the real model on (``VARIANTS``).

Weights are redrawn N(0, 0.25), norms too, as ``family_kit`` does.
"""

from __future__ import annotations

import torch

SHAPE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_hidden_layers": 3, "kv_lora_rank": 32,
         "qk_rope_head_dim": 16, "qk_nope_head_dim": 24, "v_head_dim": 20,
         "moe_intermediate_size": 48, "first_k_dense_replace": 1,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "bos_token_id": 1,
         "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}
VARIANTS = {
    "v2": {"q_lora_rank": 48, "n_routed_experts": 8, "num_experts_per_tok": 3,
           "n_shared_experts": 2, "topk_method": "greedy", "routed_scaling_factor": 1.5,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64, "beta_fast": 32,
                               "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}},
    "v2-lite": {"q_lora_rank": None, "n_routed_experts": 8, "num_experts_per_tok": 3,
                "n_shared_experts": 1, "topk_method": "group_limited_greedy", "n_group": 4,
                "topk_group": 2, "routed_scaling_factor": 2.0,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0,
                                    "original_max_position_embeddings": 32, "mscale": 1.0,
                                    "mscale_all_dim": 0.8}},
}
FEATURES = {
    "v2": ["q_lora_rank 48 (q_a_proj, q_a_layernorm, q_b_proj)", "8 experts, top 3, greedy",
           "2 shared experts", "routed_scaling_factor 1.5", "first_k_dense_replace 1",
           "YaRN x 4 with mscale = mscale_all_dim (softmax scale x mscale^2)"],
    "v2-lite": ["q_lora_rank null (q_proj)", ("8 experts, top 3, group_limited_greedy (4 groups, "
                "top 2)"), "1 shared expert", "routed_scaling_factor 2", "first_k_dense_replace 1",
                "YaRN x 8 with mscale 1 != mscale_all_dim 0.8 (cos/sin x their ratio)"],
}


def config(variant: str):
    """The transformers config of ``variant``'s tiny model."""
    import transformers as tf

    return tf.DeepseekV2Config(**SHAPE, **VARIANTS[variant])


def make_tiny(variant: str, folder, seed: int = 0):
    """Save ``variant``'s tiny random model (safetensors) in ``folder``; return it (fp32,
    eval)."""
    from family_kit import save_tiny

    return save_tiny(config(variant), folder, seed)


def hf_step(model, ids: list[int], tie: float) -> tuple[torch.Tensor, bool]:
    """(transformers' last logits after ``ids``, recomputing the whole sequence; whether, at
    any position, some MoE layer's k-th and (k+1)-th candidate scores lie within ``tie`` (after
    the group limit, transformers' own router), or the ``topk_group``-th and next group maxima
    do)."""
    cfg = model.config
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False, output_router_logits=True)
    k = cfg.num_experts_per_tok
    found = False
    for logits in out.router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        if cfg.topk_method == "group_limited_greedy":
            groups = probs.view(len(probs), cfg.n_group, -1).amax(-1)
            top = groups.topk(cfg.topk_group + 1, dim=-1).values
            found |= bool(((top[:, -2] - top[:, -1]) < tie).any())
            keep = torch.zeros_like(groups).scatter_(
                1, groups.topk(cfg.topk_group, dim=-1).indices, 1.0)
            probs = (probs.view(len(probs), cfg.n_group, -1) * keep[..., None]).view_as(probs)
        top = probs.topk(k + 1, dim=-1).values
        found |= bool(((top[:, k - 1] - top[:, k]) < tie).any())
    return out.logits[0, -1], found


def write_gguf(model, path) -> None:
    """Write ``model`` (a tiny DeepSeek-V2) as llama.cpp's converter writes a ``deepseek2`` file
    (``conversion/deepseek.py``): MLA as MQA over the latent in the metadata, ``kv_b_proj``
    split per head into ``attn_k_b`` (transposed) and ``attn_v_b``, experts stacked per
    projection, shared experts as ``ffn_*_shexp``, YaRN's ``mscale_all_dim`` as
    ``yarn_log_multiplier`` = 0.1 x it; gguf-py's own tensor names, F32 tensors."""
    import gguf
    import numpy as np
    from family_kit import _expert_tensors, add_metadata

    cfg, arch = model.config, "deepseek2"
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, cfg.num_hidden_layers)
    meta = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": 1,
            "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
            "rope.freq_base": float(rope["rope_theta"]), "vocab_size": cfg.vocab_size,
            "leading_dense_block_count": cfg.first_k_dense_replace,
            "attention.kv_lora_rank": cfg.kv_lora_rank,
            "attention.key_length": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
            "attention.value_length": cfg.kv_lora_rank,
            "attention.key_length_mla": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
            "attention.value_length_mla": cfg.v_head_dim,
            "expert_feed_forward_length": cfg.moe_intermediate_size,
            "expert_count": cfg.n_routed_experts, "expert_used_count": cfg.num_experts_per_tok,
            "expert_shared_count": cfg.n_shared_experts,
            "expert_weights_scale": float(cfg.routed_scaling_factor),
            "rope.dimension_count": cfg.qk_rope_head_dim, "rope.scaling.type": "yarn",
            "rope.scaling.factor": float(rope["factor"]),
            "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
            "rope.scaling.yarn_log_multiplier": 0.1 * rope["mscale_all_dim"]}
    if cfg.q_lora_rank:
        meta["attention.q_lora_rank"] = cfg.q_lora_rank
    add_metadata(w, arch, meta)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    heads, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
    for hf, tensor in model.state_dict().items():
        stem, _, kind = hf.rpartition(".")
        data = tensor.float().numpy().astype(np.float32)
        if ".experts." in hf or hf.endswith("mlp.gate.weight"):
            for name, part in _expert_tensors(hf, data):
                w.add_tensor(name, part)
            continue
        if stem.endswith("kv_b_proj"):
            kv_b = data.reshape(heads, nope + cfg.v_head_dim, cfg.kv_lora_rank)
            layer = hf.split(".")[2]
            w.add_tensor(f"blk.{layer}.attn_k_b.weight",
                         np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
            continue
        w.add_tensor(f"{names.get_name(stem)}.{kind}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
