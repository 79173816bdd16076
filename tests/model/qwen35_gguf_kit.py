"""A tiny Qwen3.5 / Qwen3.5-MoE model as llama.cpp's converter writes it (``qwen35`` /
``qwen35moe``, ``conversion/qwen.py``: ``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel`` over
``_LinearAttentionVReorderBase``, ``Qwen3NextModel`` and ``Qwen2MoeModel``), by gguf-py's writer
and its own tensor-name map with the converter's changes applied here, so the names and layouts
come from an implementation independent of ours (:func:`write_gguf`).

The converter's changes: the DeltaNet's value heads from grouped (the value heads of key head
g together) to tiled order (``_reorder_v_heads``) in ``in_proj_qkv``'s v rows, ``in_proj_z``,
``in_proj_a`` / ``_b``, ``A_log``, ``dt_bias``, the conv's v channels and ``out_proj``'s
columns; ``A_log`` stored as ``-exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the conv taps
squeezed to [channels, taps]; every norm but the DeltaNet's gated one stored as ``1 + w``;
the experts stacked (``ffn_*_exps``), the shared expert as ``ffn_*_shexp`` and its gate as
``ffn_gate_inp_shexp``; ``attention.recurrent_layers``, ``rope.dimension_count`` (the rotary
share) and ``full_attention_interval`` (4 unless the config says, as the converter writes it).
``mtp_blocks`` adds multi-token-prediction blocks after the decoder's, as a converter run
without ``--no-mtp`` writes them (``nextn_predict_layers``; a copy of the last layer's tensors
and the ``nextn.*`` ones), which a reader must leave out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from family_kit import _expert_tensors, add_metadata


def _tile(x: np.ndarray, axis: int, kh: int, width: int) -> np.ndarray:
    """The converter's ``_reorder_v_heads``: value-head blocks ``width`` wide along ``axis``,
    grouped [kh, r] -> tiled [r, kh]."""
    shape = list(x.shape)
    r = shape[axis] // (kh * width)
    grouped = x.reshape(*shape[:axis], kh, r, width, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(grouped, axis, axis + 1).reshape(shape))


def _linear_attn(rest: str, data: np.ndarray, cfg) -> np.ndarray:
    kh, vd = cfg.linear_num_key_heads, cfg.linear_value_head_dim
    qk = 2 * kh * cfg.linear_key_head_dim
    if rest in ("in_proj_qkv.weight", "conv1d.weight"):
        data = data.squeeze(1) if data.ndim == 3 else data
        return np.concatenate([data[:qk], _tile(data[qk:], 0, kh, vd)])
    if rest == "in_proj_z.weight":
        return _tile(data, 0, kh, vd)
    if rest in ("in_proj_a.weight", "in_proj_b.weight", "dt_bias"):
        return _tile(data, 0, kh, 1)
    if rest == "A_log":
        return _tile(-np.exp(data), 0, kh, 1)
    if rest == "out_proj.weight":
        return _tile(data, 1, kh, vd)
    return data  # the gated norm: w as it is


def write_gguf(model, path: Path, mtp_blocks: int = 0, drop: str = "") -> None:
    """The GGUF of the tiny transformers ``model`` (module docstring), F32, at ``path``;
    without the tensor named ``drop`` when one is given."""
    import gguf

    cfg = model.config
    moe = bool(getattr(cfg, "num_experts", 0))
    arch = "qwen35moe" if moe else "qwen35"
    n = cfg.num_hidden_layers
    w = gguf.GGUFWriter(str(path), arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n + mtp_blocks)
    add_metadata(w, arch, _metadata(cfg, moe, mtp_blocks))
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    tensors = []
    for hf, tensor in model.state_dict().items():
        data = tensor.float().numpy().astype(np.float32)
        stem, _, kind = hf.rpartition(".")
        if ".mlp.experts." in hf or hf.endswith("mlp.gate.weight"):
            tensors += _expert_tensors(hf, data)
            continue
        _, found, rest = hf.partition(".linear_attn.")
        if found:
            data = _linear_attn(rest, data, cfg)
            if rest in ("A_log", "dt_bias"):
                layer = hf.split(".")[2]
                part = "ssm_a" if rest == "A_log" else "ssm_dt.bias"
                tensors.append((f"blk.{layer}.{part}", data))
                continue
        elif hf.endswith("norm.weight"):
            data = data + np.float32(1.0)
        tensors.append((f"{names.get_name(stem)}.{kind}", data))
    last = f"blk.{n - 1}."
    for extra in range(n, n + mtp_blocks):
        tensors += [(f"blk.{extra}." + name.removeprefix(last), data)
                    for name, data in list(tensors) if name.startswith(last)]
        tensors += [(f"blk.{extra}.nextn.{part}.weight", np.ones((cfg.hidden_size,), np.float32))
                    for part in ("enorm", "hnorm")]
    for name, data in tensors:
        if name != drop:
            w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _metadata(cfg, moe: bool, mtp_blocks: int) -> dict:
    rope = cfg.rope_parameters
    meta = {"block_count": cfg.num_hidden_layers + mtp_blocks,
            "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
            "attention.head_count": cfg.num_attention_heads,
            "attention.head_count_kv": cfg.num_key_value_heads,
            "rope.freq_base": float(rope["rope_theta"]),
            "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
            "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
            "ssm.conv_kernel": cfg.linear_conv_kernel_dim,
            "ssm.state_size": cfg.linear_key_head_dim,
            "ssm.group_count": cfg.linear_num_key_heads,
            "ssm.time_step_rank": cfg.linear_num_value_heads,
            "ssm.inner_size": cfg.linear_value_head_dim * cfg.linear_num_value_heads,
            "attention.recurrent_layers": [t == "linear_attention" for t in cfg.layer_types]
            + [False] * mtp_blocks,
            "full_attention_interval": 4,
            "rope.dimension_count": int(cfg.head_dim * rope["partial_rotary_factor"]),
            "rope.dimension_sections": [11, 11, 10, 0]}
    if mtp_blocks:
        meta["nextn_predict_layers"] = mtp_blocks
    if moe:
        meta |= {"expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
                 "expert_feed_forward_length": cfg.moe_intermediate_size,
                 "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size}
    else:
        meta["feed_forward_length"] = cfg.intermediate_size
    return meta
