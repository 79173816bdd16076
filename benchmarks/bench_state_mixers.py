"""The state mixers alone, one layer at real shapes (issue 59): gated DeltaNet at Qwen3.5-0.8B's
(hidden 1,024; 16 key and 16 value heads of 128; conv 4) and Mamba-2 at Granite-4.0-H-Micro's
(hidden 2,048; 64 heads of 64; d_state 128; 1 group; conv 4; scanned in chunks of 64 rather
than the config's 256, see kvledger.model.layers.mamba2), random bf16 weights,
the state in bf16 as the engine keeps it (its compute dtype).

Prints, per thread count: prefill tokens/s of one ``--prompt``-token sequence (the chunked
forms, PyTorch), and the time of one decode step of ``--batch`` sequences through the PyTorch
step and through the native one (``kvledger.device.cpu.state_steps``). Both are of the mixer
alone: its two projections (the same matmuls whichever step runs, in the format the probe
picks) are replaced by their precomputed outputs, and timed apart as dense bf16 products.
Medians of ``--repeat`` runs.

Usage: python benchmarks/bench_state_mixers.py [--threads 1,2] [--prompt 512] [--batch 1]
       [--repeat 50]
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from common import machine_line, median_time

from kvledger.device.cpu.kernels import KERNELS
from kvledger.model.layers.gated_deltanet import DeltaNetShape, GatedDeltaNet
from kvledger.model.layers.mamba2 import Mamba2, Mamba2Shape
from kvledger.model.layers.state import LayerState, StateMeta
from kvledger.model.linear import Linear

QWEN35_08B = DeltaNetShape(hidden_size=1024, num_k_heads=16, num_v_heads=16, head_k_dim=128,
                           head_v_dim=128, conv_kernel=4)
GRANITE_H_MICRO = Mamba2Shape(hidden_size=2048, num_heads=64, head_dim=64, d_state=128,
                              n_groups=1, conv_kernel=4)


def _linear(out_f: int, in_f: int, gen) -> Linear:
    return Linear((torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5).bfloat16())


def mixers(kind: str, native: bool):
    """The layer at its real shape, with or without the native steps; its projections."""
    gen = torch.Generator().manual_seed(0)
    kernels = KERNELS if native else SimpleNamespace(state_mixers=lambda: None)
    if kind == "deltanet":
        s = QWEN35_08B
        proj = (_linear(s.conv_dim + s.value_dim + 2 * s.num_v_heads, s.hidden_size, gen),
                _linear(s.hidden_size, s.value_dim, gen))
        heads = s.num_v_heads
        layer = GatedDeltaNet(s, proj[0], torch.randn(s.conv_dim, 4, generator=gen) * 0.3,
                              torch.rand(heads, generator=gen), torch.randn(heads, generator=gen),
                              torch.ones(s.head_v_dim).bfloat16(), proj[1], kernels)
    else:
        s = GRANITE_H_MICRO
        proj = (_linear(s.intermediate + s.conv_dim + s.num_heads, s.hidden_size, gen),
                _linear(s.hidden_size, s.intermediate, gen))
        heads = s.num_heads
        layer = Mamba2(s, proj[0], torch.randn(s.conv_dim, 4, generator=gen) * 0.3,
                       torch.randn(s.conv_dim, generator=gen) * 0.1,
                       torch.rand(heads, generator=gen), torch.ones(heads),
                       torch.randn(heads, generator=gen), torch.ones(s.intermediate).bfloat16(),
                       proj[1], kernels)
    if native and layer.native is None:
        raise SystemExit(f"native steps unavailable: {KERNELS.why_unavailable()}")
    return s, layer, proj


def alone(layer, projected: torch.Tensor):
    """``layer`` without its projections: in_proj gives ``projected``, out_proj its input."""
    layer.in_proj, layer.out_proj = (lambda _x: projected), (lambda y: y)
    return layer


def state(shape, batch: int) -> LayerState:
    sizes = shape.state_shapes()
    return LayerState(torch.zeros(batch, *sizes["conv"], dtype=torch.bfloat16),
                      torch.zeros(batch, *sizes["recurrent"], dtype=torch.bfloat16))


def meta(lengths: list[int], fresh: bool) -> StateMeta:
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    return StateMeta(tuple(starts), tuple(lengths), (fresh,) * len(lengths))


def measure(kind: str, name: str, args, gen) -> str:
    """One line: prefill tokens/s, decode step torch vs native, the projections."""
    shape, layer, proj = mixers(kind, native=False)
    x = torch.randn(args.prompt, shape.hidden_size, generator=gen).bfloat16()
    alone(layer, proj[0](x))
    prefill = median_time(lambda: layer.forward(x, state(shape, 1), meta([args.prompt], True)),
                          max(3, args.repeat // 10))
    one = torch.randn(args.batch, shape.hidden_size, generator=gen).bfloat16()
    step_meta, held = meta([1] * args.batch, False), state(shape, args.batch)
    steps = {native: alone(mixers(kind, native)[1], proj[0](one)) for native in (False, True)}
    times = {native: median_time(lambda s=s: s.forward(one, held, step_meta), args.repeat)
             for native, s in steps.items()}
    mid = proj[0](one)[:, :proj[1].weight.shape[1]].contiguous()
    proj_s = median_time(lambda: (proj[0](one), proj[1](mid)), args.repeat)
    return (f"  {name}: prefill {args.prompt} tokens {args.prompt / prefill:8.0f} tok/s"
            f" · decode step (batch {args.batch}) torch {times[False] * 1e6:7.1f} µs,"
            f" native {times[True] * 1e6:7.1f} µs ({times[False] / times[True]:.2f}x);"
            f" its projections (dense bf16) {proj_s * 1e6:7.1f} µs")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(1)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        print(machine_line(threads))
        print(measure("deltanet", "gated DeltaNet, Qwen3.5-0.8B", args, gen))
        print(measure("mamba2", "Mamba-2, Granite-4.0-H-Micro", args, gen))


if __name__ == "__main__":
    main()
