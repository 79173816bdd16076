"""kvledger against llama.cpp at the shapes of Qwen3-0.6B and Gemma-3-1B (issue 34), one file
each: dummy weights converted to GGUF Q8_0 by llama.cpp's own converter.

``prepare`` (not timed): per model, a Hugging Face folder holding the catalogue's config.json,
kvledger's dummy weights in bf16 (``--load-format dummy``'s values) and the bundled model's
tokenizer with its vocabulary padded by unused entries to the model's size (so the converter
keeps the real embedding and LM head), then ``convert_hf_to_gguf.py --outtype q8_0``.
``time``: batch-1 TTFT and TPOT with 512- and 4096-token prompts (64 new tokens, greedy, EOS
ignored, the default fast mode) next to ``llama-bench`` decode (tg64 at depth 512 / 4096) and
prefill (pp512) on the same file and threads.

Usage:
  python benchmarks/bench_families.py prepare --work DIR --llama-src SRC [--sentencepiece DIR]
  python benchmarks/bench_families.py time --work DIR [--threads 2]
(``SRC``: llama.cpp's source tree, holding convert_hf_to_gguf.py and gguf-py; the converter
imports sentencepiece, which ``--sentencepiece`` puts on its path. llama-bench comes from
``$KVLEDGER_LLAMA_CPP_DIR``, ik_llama.cpp's (run with ``-rtr 1 -fa 1``) from
``$KVLEDGER_IK_LLAMA_DIR``, ``peer_llamacpp.py``. The folders: ``dummy_gguf.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import peer_llamacpp as peer
from common import machine_line, real_text_ids
from dummy_gguf import command_line, dummy_folder

MODELS = {"qwen3-0.6b": "Qwen/Qwen3-0.6B", "gemma3-1b": "google/gemma-3-1b-it"}


def prepare(args) -> None:
    from kvledger.model.catalogue import lookup

    work = Path(args.work)
    for name, model_id in MODELS.items():
        config = json.loads(Path(lookup(model_id).path).read_text())
        folder = dummy_folder(work / f"{name}-hf", config)
        out = peer.convert_hf_to_gguf(folder, work / f"{name}-q8_0.gguf", "q8_0",
                                      args.llama_src, args.sentencepiece)
        print(f"{name}: {out} ({out.stat().st_size / 1e9:.2f} GB)")


def ours(path: Path, threads: int, contexts: tuple[int, ...], new: int) -> dict:
    from kvledger import LLM, SamplingParams

    llm = LLM(str(path), enable_prefix_caching=False, num_threads=threads)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([real_text_ids(llm.tokenizer, 64)], params)  # warm-up
    model = llm.engine.model
    result = {"formats": model.weight_formats, "attention": model.attention.name}
    for ctx in contexts:
        out = llm.generate([real_text_ids(llm.tokenizer, ctx)], params)[0]
        result[ctx] = {"ttft_ms": out.metrics.ttft_s * 1e3, "tpot_ms": out.tpot_s * 1e3}
    return result


def time_models(args) -> None:
    print(machine_line(args.threads))
    contexts = (512, 4096)
    for name in args.models or MODELS:
        path = Path(args.work) / f"{name}-q8_0.gguf"
        mine = ours(path, args.threads, contexts, args.new)
        print(f"{name} kvledger: formats {mine['formats']}, attention {mine['attention']}")
        for ctx in contexts:
            print(f"  prompt {ctx}: TTFT {mine[ctx]['ttft_ms']:.0f} ms, "
                  f"TPOT {mine[ctx]['tpot_ms']:.1f} ms")
        for which in (peer.LLAMA_CPP, peer.IK_LLAMA):
            for line in peer.bench_lines(path, args.threads, 512, args.new, contexts,
                                         peer=which):
                print(" ", line)


def main() -> None:
    args = command_line(sorted(MODELS), new=64)[0].parse_args()
    prepare(args) if args.cmd == "prepare" else time_models(args)


if __name__ == "__main__":
    main()
