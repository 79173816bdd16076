"""Llama, Mistral and Qwen2 / 2.5: the plain decoder (Touvron et al., "LLaMA",
arXiv:2302.13971; GQA: Ainslie et al., arXiv:2305.13245): RMSNorm, attention with RoPE,
SwiGLU MLP; Mistral's uniform sliding window, Qwen2's q/k/v biases and its sliding layers
(``use_sliding_window``, from ``max_window_layers``).

GGUF: ``llama`` (a file with experts is Mixtral: llama.cpp's converter writes it so),
``mistral`` and ``qwen2``; the converter permutes the attn_q / attn_k rows of ``llama`` and
``mistral`` for ggml's interleaved RoPE (``kvledger.model.weights.gguf_tensors``); K-quant
matrices are held as the file's blocks.
"""

from __future__ import annotations

from kvledger.model.layers import plain_decoder
from kvledger.spec import (
    Config,
    Family,
    GGUFHeader,
    any_value,
    full_and_sliding,
    uniform_window,
    use_sliding_window,
)


def _config_fields(c: Config, n: int) -> dict:
    return {"qkv_bias": True} if c.model_type == "qwen2" else {}


def _layer_types(c: Config, n: int) -> tuple[str, ...] | None:
    if c.model_type == "mistral":
        return uniform_window(c, n)
    return use_sliding_window(c, n) if c.model_type == "qwen2" else None


def _gguf_fields(header: GGUFHeader, fields: dict) -> dict:
    return {"model_type": "mixtral"} if fields.get("num_experts") else {}


FAMILY = Family(
    name="llama",
    model_types=("llama", "mistral", "qwen2"),
    runs={"layer_types": full_and_sliding, "sliding_window": any_value},  # Mistral's window
    config_fields=_config_fields,
    layer_types=_layer_types,
    gguf_archs={"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"},
    gguf_fields=_gguf_fields,
    gguf_rope_permuted=frozenset({"llama", "mistral"}),
    gguf_kquant_blocks=True,
    model=plain_decoder,
)
