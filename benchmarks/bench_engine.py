"""Paged-engine benchmarks (issue 4): batch throughput, KV memory, shared-prefix TTFT.

1. Throughput: 32 requests with 256-512-token real-text prompts and 128 output tokens (greedy,
   EOS ignored), total output tok/s, ours (one continuous batch) vs Hugging Face transformers
   batched ``generate`` (left-padded batch) at the same dtype and threads.
2. Memory: the most KV bytes our pool held during that batch (blocks in use x bytes per block)
   vs transformers' cache for the same padded batch, and vs the ledger's prediction (must be
   within one partial block per sequence).
3. Shared prefix: 16 requests sharing a 1,024-token system prompt with different 32-token
   questions, one after another: TTFT p50 with and without the prefix cache.

Usage: python benchmarks/bench_engine.py [--dtype bf16|fp32] [--threads 2] [--skip-hf]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import load_hf_peer, machine_line, real_text_ids

from kvledger import LLM, SamplingParams
from kvledger.ledger.kv import kv_bytes_per_sequence


def batch_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [real_text_ids(tokenizer, rng.randint(256, 512), offset=i * 600) for i in range(n)]


def ours_throughput(llm: LLM, prompts, new: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    peak_blocks = 0
    t = time.perf_counter()
    for _ in llm.stream(prompts, params):
        s = llm.engine.stats()
        peak_blocks = max(peak_blocks, s["kv_blocks_total"] - s["kv_blocks_free"])
    elapsed = time.perf_counter() - t
    return len(prompts) * new / elapsed, peak_blocks * llm.engine.bytes_per_block


def hf_throughput(model, prompts, new: int) -> tuple[float, int]:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as transformers wants for generation
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    elapsed = time.perf_counter() - t
    cache = out.past_key_values
    kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return len(prompts) * new / elapsed, kv_bytes


def shared_prefix_ttft(llm: LLM, tokenizer, n: int = 16) -> float:
    system = real_text_ids(tokenizer, 1024, offset=40_000)
    ttfts = []
    for i in range(n):
        question = real_text_ids(tokenizer, 32, offset=60_000 + 100 * i)
        out = llm.generate([system + question], SamplingParams(max_tokens=1, temperature=0.0))[0]
        ttfts.append(out.metrics.ttft_s)
    return statistics.median(ttfts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line(args.threads), "·", args.dtype)

    llm = LLM("default", dtype=args.dtype, max_num_seqs=args.requests)
    prompts = batch_prompts(llm.tokenizer, args.requests)
    tps, ours_kv = ours_throughput(llm, prompts, args.new)
    spec, fmt = llm.engine.spec, llm.engine.kv_layout.fmt
    held_tokens = [len(p) + args.new - 1 for p in prompts]
    ledger = sum(kv_bytes_per_sequence(spec, fmt, 1, 16, t) for t in held_tokens)
    slack = len(prompts) * llm.engine.bytes_per_block
    print(f"throughput, {args.requests} requests, prompts 256-512, {args.new} new tokens")
    print(f"  kvledger      {tps:7.1f} output tok/s")
    print(f"KV memory: kvledger peak {ours_kv / 2**20:8.1f} MiB, ledger {ledger / 2**20:8.1f} "
          f"MiB (difference {(ours_kv - ledger) / 2**20:.1f} MiB, allowed < one block per "
          f"sequence = {slack / 2**20:.1f} MiB)")
    if not args.skip_hf:
        hf, _ = load_hf_peer(args.dtype)
        hf_tps, hf_kv = hf_throughput(hf, prompts, args.new)
        print(f"  transformers  {hf_tps:7.1f} output tok/s -> ours/HF {tps / hf_tps:.2f}x "
              "(target >= 3x)")
        print(f"  transformers padded KV cache {hf_kv / 2**20:8.1f} MiB -> "
              f"{hf_kv / ours_kv:.2f}x ours")

    on = shared_prefix_ttft(LLM("default", dtype=args.dtype), llm.tokenizer)
    off = shared_prefix_ttft(LLM("default", dtype=args.dtype, enable_prefix_caching=False),
                             llm.tokenizer)
    print("shared 1,024-token prefix, 16 requests with 32-token questions, TTFT p50:")
    print(f"  prefix cache on {on * 1e3:7.1f} ms, off {off * 1e3:7.1f} ms -> {off / on:.1f}x "
          "lower (target >= 10x)")


if __name__ == "__main__":
    main()
