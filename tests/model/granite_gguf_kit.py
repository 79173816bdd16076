"""A tiny Granite-4.0-H folder as llama.cpp's converter writes it (``granitehybrid``,
``conversion/granite.py`` ``GraniteHybridModel`` over ``mamba.py`` ``Mamba2Model`` and
``GraniteMoeModel``): :func:`write_gguf` with gguf-py's writer and its own tensor-name map, the
converter's changes applied to the checkpoint's tensors (read from the folder, as the converter
reads them), so the names and layouts come from an implementation independent of ours; and
:func:`convert`, the converter itself when ``KVLEDGER_LLAMA_CPP_SRC`` names its source tree
(:mod:`llama_cpp_kit`).

The converter's changes: ``A_log`` stored as ``-exp(A_log)`` and ``D`` both [heads, 1] without
a ``.weight`` suffix (``ssm_a`` / ``ssm_d``), the conv taps squeezed to [channels, taps], the
gated norm as [groups, inner / groups], ``dt_bias`` as ``ssm_dt.bias``; the experts'
``input_linear`` split into gate and up, the shared MLP's into gate and up (``*_shexp`` on an MoE
model, the plain ``ffn_*`` on a dense one); q / k rows permuted as ``LlamaModel.permute``; the
multipliers as ``*_scale`` keys; ``rope.scaling.finetuned`` false (no RoPE on a hybrid).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from family_kit import _permute, add_metadata
from llama_cpp_kit import convert as llama_cpp_convert


def write_gguf(folder: Path, path: Path, drop: str = "") -> None:
    """The GGUF of the tiny Granite folder (module docstring), F32, at ``path``; without the
    tensor named ``drop`` when one is given."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    n, moe = cfg["num_hidden_layers"], bool(cfg["num_local_experts"])
    attention = [i for i, t in enumerate(cfg["layer_types"]) if "attention" in t
                 and "linear" not in t]
    w = gguf.GGUFWriter(str(path), "granitehybrid")
    add_metadata(w, "granitehybrid", _metadata(cfg, attention))
    w.add_bool("granitehybrid.rope.scaling.finetuned", False)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, n)
    for hf, data in load_file(str(folder / "model.safetensors")).items():
        for name, array in _tensors(hf, data.astype(np.float32), cfg, names, moe):
            if name != drop:
                w.add_tensor(name, np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _metadata(cfg: dict, attention: list[int]) -> dict:
    heads = cfg["hidden_size"] // cfg["num_attention_heads"]
    return {"block_count": cfg["num_hidden_layers"], "context_length": 1 << 20,
            "embedding_length": cfg["hidden_size"],
            "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": [cfg["num_key_value_heads"] if i in attention else 0
                                        for i in range(cfg["num_hidden_layers"])],
            "rope.freq_base": 10000.0, "rope.dimension_count": heads,
            "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]),
            "expert_count": cfg["num_local_experts"],
            "expert_used_count": cfg["num_experts_per_tok"], "vocab_size": cfg["vocab_size"],
            "attention.scale": float(cfg["attention_multiplier"]),
            "embedding_scale": float(cfg["embedding_multiplier"]),
            "residual_scale": float(cfg["residual_multiplier"]),
            "logit_scale": float(cfg["logits_scaling"]),
            "expert_shared_feed_forward_length": cfg["shared_intermediate_size"],
            "ssm.conv_kernel": cfg["mamba_d_conv"], "ssm.state_size": cfg["mamba_d_state"],
            "ssm.group_count": cfg["mamba_n_groups"],
            "ssm.inner_size": cfg["mamba_n_heads"] * cfg["mamba_d_head"],
            "ssm.time_step_rank": cfg["mamba_n_heads"]}


def _tensors(hf: str, data: np.ndarray, cfg: dict, names, moe: bool):
    """(GGUF name, array) of one checkpoint tensor, as the converter writes it."""
    stem, _, kind = hf.rpartition(".")
    layer = hf.split(".")[2] if hf.startswith("model.layers.") else ""
    if hf.endswith((".A_log", ".D")):
        value = -np.exp(data) if hf.endswith("A_log") else data
        return [(names.get_name(hf), value.reshape(-1, 1))]
    if hf.endswith("dt_bias"):
        return [(f"blk.{layer}.ssm_dt.bias", data)]
    if hf.endswith("conv1d.weight"):
        data = data.squeeze(1)
    elif hf.endswith("mamba.norm.weight"):
        data = data.reshape(cfg["mamba_n_groups"], -1)
    elif "input_linear" in hf:
        gate, up = np.split(data, 2, axis=-2)
        suffix = "exps" if "block_sparse_moe" in hf else ("shexp" if moe else "")
        return [(f"blk.{layer}.ffn_{part}{'_' + suffix if suffix else ''}.weight", x)
                for part, x in (("gate", gate), ("up", up))]
    elif hf.endswith("shared_mlp.output_linear.weight") and not moe:
        return [(f"blk.{layer}.ffn_down.weight", data)]
    elif stem.endswith(("q_proj", "k_proj")):
        heads = cfg["num_attention_heads"] if "q_proj" in stem else cfg["num_key_value_heads"]
        data = _permute(data, heads)
    return [(f"{names.get_name(stem)}.{kind}", data)]


def convert(folder: Path, path: Path) -> bool:
    """llama.cpp's own converter on the folder (:func:`llama_cpp_kit.convert`); False when
    ``KVLEDGER_LLAMA_CPP_SRC`` is not set. The hub's layer kinds (``mamba`` / ``attention``)
    are written back first: the converter reads those, not transformers 5's spelling."""
    if not os.environ.get("KVLEDGER_LLAMA_CPP_SRC"):
        return False
    cfg = json.loads((folder / "config.json").read_text())
    cfg["layer_types"] = ["mamba" if t == "linear_attention" else "attention"
                          for t in cfg["layer_types"]]
    (folder / "config.json").write_text(json.dumps(cfg))
    return llama_cpp_convert(folder, path)
