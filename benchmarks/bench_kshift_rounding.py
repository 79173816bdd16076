"""Why ``--kv-positions cache`` turns keys as attention gathers them instead of in the blocks.

An in-place K-shift (llama.cpp's way of moving kept keys to new positions) rotates the stored
keys by the shift in fp32 and stores them back in the cache's 16-bit format, once per shift. A
per-token stream (StreamingLLM's positions) shifts every key about once per generated token, so
the rounding is repeated. This compares, on 256 random 64-dim keys (RoPE theta 1e5, the bundled
model's), the median relative error against float64 of (a) N one-position shifts, each stored
back in bf16 / fp16, and (b) one rotation by N from the key as computed, stored once.

Usage: python benchmarks/bench_kshift_rounding.py
"""

from __future__ import annotations

import torch

from kvledger.model.layers.rotary import RotaryEmbedding


def median_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    """Median over keys of |y - exact| / |exact| (y, exact: [keys, 1, D])."""
    return float((y.double() - exact).norm(dim=-1).div(exact.norm(dim=-1)).median())


def main() -> None:
    torch.manual_seed(0)
    dim, theta, keys = 64, 100000.0, 256
    rope32 = RotaryEmbedding(dim, 4, theta, None, torch.float32)
    rope64 = RotaryEmbedding(dim, 4, theta, None, torch.float64)
    one = rope32.lookup(torch.ones(keys, dtype=torch.int64))
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(keys, 1, dim, dtype=torch.float64)
        for shifts in (100, 1000, 16000):
            exact = RotaryEmbedding.apply(x, *rope64.lookup(torch.full((keys,), shifts)))
            k = x.to(dtype)
            for _ in range(shifts):
                k = RotaryEmbedding.apply(k.float(), *one).to(dtype)
            once = RotaryEmbedding.apply(x.to(dtype).float(),
                                         *rope32.lookup(torch.full((keys,), shifts))).to(dtype)
            print(f"{str(dtype).removeprefix('torch.'):9s} {shifts:6d} shifts: in place "
                  f"{median_error(k, exact):.2e}, once {median_error(once, exact):.2e}")


if __name__ == "__main__":
    main()
