"""Batch-1 TTFT and TPOT, ours vs Hugging Face transformers, plus the no-cache/cache ratio.

Issue 2's benchmark: a 512-token real-text prompt and 128 new tokens (greedy, EOS ignored), the
same weights (the bundled GGUF), dtype and threads for both (``--prompt 512,2048,4096``: one row
per prompt length, for issue 10's TTFT at 512 / 2048 / 4096); then our no-KV-cache TPOT over our
cached TPOT at 256, 512 and 1024 tokens of context (seed §1.3: the O(S^2) argument measured);
then the model load time from the weight cache.

Usage: python benchmarks/bench_generate.py [--dtype fp32|bf16] [--threads 2] [--repeat 3]
       [--prompt 512[,2048,...]] [--new 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import load_hf_peer, machine_line, median_time, real_text_ids

from kvledger import LLM, SamplingParams


def ours_ttft_tpot(llm: LLM, ids: list[int], new: int, repeat: int) -> tuple[float, float]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    llm.generate([ids], params)  # warm-up
    runs = [llm.generate([ids], params)[0] for _ in range(repeat)]
    return (statistics.median(o.metrics.ttft_s for o in runs),
            statistics.median(o.tpot_s for o in runs))


def hf_ttft_tpot(model, ids: list[int], new: int, repeat: int, use_cache=True):
    x = torch.tensor([ids])

    def gen(n):
        return lambda: model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      use_cache=use_cache, pad_token_id=0)

    with torch.inference_mode():
        ttft = median_time(gen(1), repeat)
        e2e = median_time(gen(new), repeat)
    return ttft, (e2e - ttft) / (new - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--prompt", default="512", help="prompt lengths, comma-separated")
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads), "·", args.dtype)

    t = time.perf_counter()
    llm = LLM("default", dtype=args.dtype, enable_prefix_caching=False)
    load_s = time.perf_counter() - t
    hf, _ = load_hf_peer(args.dtype)
    for prompt in map(int, args.prompt.split(",")):
        ids = real_text_ids(llm.tokenizer, prompt)
        ttft, tpot = ours_ttft_tpot(llm, ids, args.new, args.repeat)
        hf_ttft, hf_tpot = hf_ttft_tpot(hf, ids, args.new, args.repeat)
        print(f"prompt {prompt}, {args.new} new tokens, batch 1")
        print(f"  kvledger      TTFT {ttft * 1e3:7.1f} ms   TPOT {tpot * 1e3:6.1f} ms")
        print(f"  transformers  TTFT {hf_ttft * 1e3:7.1f} ms   TPOT {hf_tpot * 1e3:6.1f} ms")
        print(f"  ratio ours/HF TTFT {ttft / hf_ttft:.2f}x      TPOT {tpot / hf_tpot:.2f}x "
              "(target TPOT <= 0.5x)")

    print("no-KV-cache TPOT / cached TPOT (ours, 8 new tokens):")
    nocache = LLM("default", dtype=args.dtype, use_kv_cache=False, enable_prefix_caching=False)
    for ctx in (256, 512, 1024):
        ctx_ids = real_text_ids(llm.tokenizer, ctx)
        _, cached = ours_ttft_tpot(llm, ctx_ids, 8, 1)
        _, uncached = ours_ttft_tpot(nocache, ctx_ids, 8, 1)
        print(f"  context {ctx:5d}: cached {cached * 1e3:6.1f} ms, no cache "
              f"{uncached * 1e3:7.1f} ms -> {uncached / cached:5.1f}x")
    _, hf_nc = hf_ttft_tpot(hf, real_text_ids(llm.tokenizer, 512), 8, 1, use_cache=False)
    print(f"  transformers no-cache TPOT at 512: {hf_nc * 1e3:.1f} ms")
    print(f"model load (weight + tokenizer cache warm): {load_s:.2f} s")


if __name__ == "__main__":
    main()
