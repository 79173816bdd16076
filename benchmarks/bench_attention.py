"""Decode attention alone: one query per layer over every layer of a bf16 pool (issue 10).

The bundled model's shape (layers, heads, KV heads, head size; block size 16), a pool of
``--contexts`` tokens per layer filled with random K/V, and one decode step of attention: each
layer's backend call in turn, as a decode step makes them, so the pool (``layers x context x
KV bytes per token``; 94 MB at 4,096 tokens for SmolLM2-135M) streams from memory rather than
the caches. Prints ms per step (all layers) and the GB/s of K/V read; this step's floor is the
pool's bytes at the bandwidth ``kvledger probe`` prints.

``--softcap C`` soft-caps every layer's scores at C (Gemma 2's attn_logit_softcapping: the
native kernel takes it since issue 55; before, such layers went to paged-torch).

Usage: python benchmarks/bench_attention.py [--threads 2] [--contexts 512,2048,4096]
       [--backend paged-native] [--repeat 20] [--softcap 50]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import machine_line

from kvledger.device import resolve
from kvledger.engine.attention import AttentionMetadata, make_backend
from kvledger.engine.attention.layer import LayerAttention
from kvledger.engine.attention.metadata import DecodeGroup
from kvledger.engine.kv.store import KVStore
from kvledger.model.families import load_spec

BLOCK = 16


def step_ms(backend, store: KVStore, q: torch.Tensor, context: int, repeat: int) -> float:
    """Best time of one decode step's attention (every layer once) over ``context`` tokens."""
    meta = AttentionMetadata(None, decodes=[DecodeGroup(0, 1, torch.arange(context)[None], None)])
    empty = q[:0, :store.num_kv_heads]
    layers = len(store.key_blocks)
    best = float("inf")
    for _ in range(repeat + 1):  # the first round warms up
        t = time.perf_counter()
        for layer in range(layers):
            backend(layer, q, empty, empty, meta, store)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="512,2048,4096")
    ap.add_argument("--backend", default="paged-native")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--softcap", type=float, help="soft-cap every layer's scores at this value")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cap = "" if args.softcap is None else f" · soft-cap {args.softcap:g}"
    print(machine_line(args.threads), "·", args.backend + cap)
    spec = load_spec("default")
    contexts = [int(c) for c in args.contexts.split(",")]
    blocks = -(-max(contexts) // BLOCK)
    store = KVStore(spec.num_layers, blocks, BLOCK, spec.num_kv_heads, spec.head_dim,
                    torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for keys, values in zip(store.key_blocks, store.value_blocks):
        keys.copy_(torch.randn(keys.shape, generator=gen))
        values.copy_(torch.randn(values.shape, generator=gen))
    q = torch.randn(1, spec.num_attention_heads, spec.head_dim, generator=gen).bfloat16()
    backend = make_backend(args.backend, resolve("cpu").kernels)
    if args.softcap is not None:
        backend.set_layers([LayerAttention(spec.head_dim ** -0.5, softcap=args.softcap)]
                           * spec.num_layers)
    token_bytes = 2 * spec.num_kv_heads * spec.head_dim * 2 * spec.num_layers
    for context in contexts:
        ms = step_ms(backend, store, q, context, args.repeat)
        print(f"  context {context:5d}: {ms:6.2f} ms per step ({spec.num_layers} layers), "
              f"{context * token_bytes / ms / 1e6:5.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
