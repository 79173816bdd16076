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
``$KVLEDGER_LLAMA_CPP_DIR``, ``peer_llamacpp.py``.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import peer_llamacpp as peer
from common import machine_line, real_text_ids

MODELS = {"qwen3-0.6b": "Qwen/Qwen3-0.6B", "gemma3-1b": "google/gemma-3-1b-it"}


def _padded_tokenizer(folder: Path, vocab_size: int) -> None:
    """The bundled tokenizer saved in ``folder``, its BPE vocabulary padded to ``vocab_size``
    entries that no merge produces (the encoding is unchanged)."""
    from kvledger.model.weights.loader import load_tokenizer

    load_tokenizer("default").save_pretrained(folder)
    path = folder / "tokenizer.json"
    doc = json.loads(path.read_text())
    vocab = doc["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"<unused_{i}>"] = i
    path.write_text(json.dumps(doc))


def prepare(args) -> None:
    import shutil

    import torch
    from safetensors.torch import save_file

    from kvledger.catalogue import lookup
    from kvledger.model.weights.loader import load_weights

    work = Path(args.work)
    for name, model_id in MODELS.items():
        folder = work / f"{name}-hf"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(lookup(model_id).path, folder / "config.json")
        spec, weights = load_weights(model_id, torch.bfloat16, "dummy")
        save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
        del weights
        _padded_tokenizer(folder, spec.vocab_size)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(Path(args.llama_src) / "gguf-py"), args.sentencepiece) if p))
        out = work / f"{name}-q8_0.gguf"
        subprocess.run([sys.executable, str(Path(args.llama_src) / "convert_hf_to_gguf.py"),
                        str(folder), "--outtype", "q8_0", "--outfile", str(out)], env=env,
                       check=True)
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
        if peer.binary("llama-bench") is None:
            print(" ", peer.skip_reason("llama-bench"))
            continue
        rows = peer.llama_bench(path, args.threads, 512, args.new, contexts)
        for row in rows:
            kind = "pp512" if row["n_prompt"] else f"tg{args.new}"
            per_token = 1e3 / row["avg_ts"]
            what = (f"TTFT {row['n_prompt'] * per_token:.0f} ms" if row["n_prompt"]
                    else f"TPOT {per_token:.1f} ms")
            print(f"  llama.cpp {kind} at depth {row['n_depth']}: {row['avg_ts']:.1f} tok/s "
                  f"({what})")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--work", required=True)
    p.add_argument("--llama-src", required=True)
    p.add_argument("--sentencepiece", default="")
    t = sub.add_parser("time")
    t.add_argument("--work", required=True)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--new", type=int, default=64)
    t.add_argument("--models", nargs="*", choices=sorted(MODELS))
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else time_models(args)


if __name__ == "__main__":
    main()
