"""Random-weight GGUFs of a real shape, converted and quantized with llama.cpp's own tools
(issue 42's benchmark models).

1. A Llama of Llama-3.2-1B's sizes (hidden 2048, 16 layers, MLP 8192, 32 query / 8 KV heads,
   head_dim 64, tied embeddings; no llama3 RoPE scaling, which the engine does not run) with the
   bundled model's vocabulary (49,152): 1.07 B parameters, random weights from transformers'
   own initialisation, saved in bf16 with the bundled tokenizer.
2. ``convert_hf_to_gguf.py --outtype bf16`` from the llama.cpp source tree
   (``$KVLEDGER_LLAMA_CPP_SRC``; it needs ``sentencepiece`` importable, e.g. from a
   ``pip install --target`` folder given as ``--sentencepiece``).
3. ``llama-quantize`` (``$KVLEDGER_LLAMA_CPP_DIR``) to each type asked (default Q4_K_M, Q5_K_M,
   Q6_K).

Usage: python benchmarks/kquant_models.py OUT_DIR [--types Q4_K_M,Q5_K_M,Q6_K]
       [--sentencepiece DIR]
Prints each file's path and size. Files that already exist are kept.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import torch
from peer_llamacpp import convert_hf_to_gguf


def hf_model(folder: Path) -> Path:
    """Save the random Llama-3.2-1B-shaped model and the bundled tokenizer to ``folder``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvledger.paths import bundled_model_path

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                      num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=64, max_position_embeddings=8192, tie_word_embeddings=True,
                      rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    gguf = bundled_model_path()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


def convert(folder: Path, target: Path, sentencepiece: str | None) -> Path:
    """``convert_hf_to_gguf.py`` of ``folder`` to a bf16 GGUF at ``target``."""
    if target.is_file():
        return target
    return convert_hf_to_gguf(folder, target, "bf16", os.environ["KVLEDGER_LLAMA_CPP_SRC"],
                              sentencepiece)


def quantize(source: Path, target: Path, type_name: str) -> Path:
    """``llama-quantize source target type_name``."""
    if not target.is_file():
        exe = Path(os.environ["KVLEDGER_LLAMA_CPP_DIR"]) / "llama-quantize"
        subprocess.run([str(exe), str(source), str(target), type_name], check=True,
                       stdout=subprocess.DEVNULL)
    return target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K")
    ap.add_argument("--sentencepiece", default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bf16 = convert(hf_model(args.out / "hf"), args.out / "llama1b-bf16.gguf", args.sentencepiece)
    for type_name in args.types.split(","):
        path = quantize(bf16, args.out / f"llama1b-{type_name}.gguf", type_name)
        print(f"{path}  {path.stat().st_size / 1e9:.3f} GB")


if __name__ == "__main__":
    main()
