"""kvledger against llama.cpp at LFM2-1.2B's shape (issue 59): random weights converted to GGUF
Q8_0 by llama.cpp's own converter, batch-1 TTFT and TPOT next to ``llama-bench`` on the same
file and threads.

``prepare`` (not timed): a Hugging Face folder holding the catalogue's LFM2-1.2B config.json,
transformers' own random initialisation of ``Lfm2ForCausalLM`` in bf16 (LFM2's checkpoint
names, which the converter reads; kvledger's dummy weights are in its common names) and the
bundled model's tokenizer padded to the vocabulary (``dummy_gguf.padded_tokenizer``), then
``convert_hf_to_gguf.py --outtype q8_0``. ``time``: as ``bench_families.py``.

Usage:
  python benchmarks/bench_lfm2.py prepare --work DIR --llama-src SRC [--sentencepiece DIR]
  python benchmarks/bench_lfm2.py time --work DIR [--threads 1]
"""

from __future__ import annotations

import json
from pathlib import Path

import peer_llamacpp as peer
from bench_families import ours
from common import machine_line
from dummy_gguf import command_line, padded_tokenizer

MODEL = "LiquidAI/LFM2-1.2B"
NAME = "lfm2-1.2b"


def prepare(args) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvledger.model.catalogue import lookup

    folder = Path(args.work) / f"{NAME}-hf"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(Path(lookup(MODEL).path).read_text())
    config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    padded_tokenizer(folder, json.loads((folder / "config.json").read_text())["vocab_size"])
    out = peer.convert_hf_to_gguf(folder, Path(args.work) / f"{NAME}-q8_0.gguf", "q8_0",
                                  args.llama_src, args.sentencepiece)
    print(f"{NAME}: {out} ({out.stat().st_size / 1e9:.2f} GB)")


def time_model(args) -> None:
    print(machine_line(args.threads))
    contexts = (512, 4096)
    path = Path(args.work) / f"{NAME}-q8_0.gguf"
    mine = ours(path, args.threads, contexts, args.new)
    print(f"{NAME} kvledger: formats {mine['formats']}, attention {mine['attention']}")
    for ctx in contexts:
        print(f"  prompt {ctx}: TTFT {mine[ctx]['ttft_ms']:.0f} ms, "
              f"TPOT {mine[ctx]['tpot_ms']:.1f} ms")
    for line in peer.bench_lines(path, args.threads, 512, args.new, contexts):
        print(" ", line)


def main() -> None:
    args = command_line([NAME], new=32)[0].parse_args()
    prepare(args) if args.cmd == "prepare" else time_model(args)


if __name__ == "__main__":
    main()
