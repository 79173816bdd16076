"""Decode GEMV bandwidth per weight format and shape, beside the machine's copy bandwidth
(issue 55, item 1).

A decode step multiplies one activation row by every weight matrix, so each product should
stream its weight from memory at close to the copy bandwidth. For every weight format the
engine has (:data:`kvledger.model.linear.FORMATS`: ``dense`` bf16, torch's ``int8`` and
``int4``, the native ``w8a8`` / ``w4a8``; and the GGUF block types of
:data:`kvledger.model.kquant.BLOCK_TYPES` on each path the native library was built with) this
times ``y = x @ W.T`` for x [1, in] bf16 at the shapes of the 1 B models (``--shapes``, out x
in) and at 1 and 2 threads, and prints the weight bytes read per second (codes, scales and
minima: :attr:`Linear.nbytes` or the blocks' bytes) and that figure over the copy bandwidth
measured the way ``kvledger probe`` measures it (:func:`kvledger.device.measure.measure`: the
best copy of a 512 MiB buffer, read + written bytes, at the same thread count), before and
after that thread count's rows (the machine may be shared: the percentages use their mean).

Each format gets enough copies of its weight to fill ``--pool-mib`` (well above the last-level
cache), and the calls cycle through them, so every call reads its weight from DRAM as in a model
whose weights do not fit in cache. A row's figure is the best of ``--rounds`` passes (as the
copy figure is the best of its copies: peak against peak, the least disturbed by the other
processes of a shared machine). ``--clock cpu`` times both the copies and the products by this
process's CPU time instead of the wall clock (the probe's copy, same buffer and count, on that
clock): on a machine with more runnable processes than cores a wall-clock figure measures the
share of the CPU the process got, the CPU-time one what the code does with a core it holds
(meaningful at 1 thread only: a waiting OpenMP thread spins and its CPU time counts).
Weights are random (their values do not change the work). Usage:
python benchmarks/bench_gemv.py [--threads 1 2] [--shapes 2048x8192 8192x2048 2048x2048]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import machine_line

from kvledger.device import resolve
from kvledger.device.measure import measure
from kvledger.model.kquant import BLOCK_TYPES, random_matrix
from kvledger.model.linear import Linear

TARGET = 0.8
"""The issue's target: every format at >= 80 % of copy bandwidth."""
LINEAR_FORMATS = ("dense", "int8", "int4", "w8a8", "w4a8")


def _linear(fmt: str, out: int, inp: int, gen: torch.Generator, kernels):
    """One ``fmt`` Linear of random weights (the Q4 formats from random Q4 parts)."""
    if fmt in ("int4", "w4a8"):
        q = torch.randint(0, 16, (out, inp), dtype=torch.uint8, generator=gen)
        scale = torch.rand(out, inp // 32, generator=gen) * 1e-2
        lin = Linear.from_q4((q, scale, -8 * scale), (out, inp), fmt=fmt, kernels=kernels)
    else:
        w = (torch.randn(out, inp, generator=gen) * 0.02).to(torch.bfloat16)
        lin = Linear(w, fmt=fmt, kernels=kernels)
    if lin.format != fmt:
        return None
    return lin, lin.nbytes


def _blocks(type_name: str, isa: str, out: int, inp: int, gen: torch.Generator, kquant):
    m = random_matrix(type_name, out, inp, gen)
    return kquant.bind([(type_name, m.data)], inp, isa), m.data.nbytes


def _candidates(kernels) -> list[tuple[str, object]]:
    """(row label, maker(out, in, generator) -> (callable, bytes) or None) of every format."""
    rows = [(fmt, lambda o, i, g, f=fmt: _linear(f, o, i, g, kernels)) for fmt in LINEAR_FORMATS]
    kquant = kernels.kquant()
    if kquant is not None:
        for type_name in BLOCK_TYPES:
            for isa in kquant.isas:
                if isa != "scalar":
                    rows.append((f"{type_name} {isa}", lambda o, i, g, t=type_name, s=isa:
                                 _blocks(t, s, o, i, g, kquant)))
    return rows


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def copy_gbs(clock) -> float:
    """The probe's copy bandwidth (:func:`kvledger.device.measure.measure`: the best of 5
    copies of a 512 MiB buffer, read + written bytes) timed by ``clock``."""
    src = torch.ones(512 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = clock()
        dst.copy_(src)
        best = min(best, clock() - t)
    return 2 * src.numel() / best / 1e9


def gbs(maker, out: int, inp: int, pool_bytes: int, rounds: int,
        clock=time.perf_counter) -> float | None:
    """Weight GB/s of the product (best of ``rounds`` passes over the copies), or None
    when the format does not take the shape here."""
    gen = torch.Generator().manual_seed(0)
    first = maker(out, inp, gen)
    if first is None:
        return None
    copies = [first]
    while len(copies) * first[1] < pool_bytes:
        copies.append(maker(out, inp, gen))
    x = torch.randn(1, inp, generator=gen).to(torch.bfloat16)
    for fn, _ in copies:  # warm-up: first touch, thread team
        fn(x)
    per_call = []
    for _ in range(rounds):
        t = clock()
        for fn, _ in copies:
            fn(x)
        per_call.append((clock() - t) / len(copies))
    return first[1] / min(per_call) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shapes", nargs="+", default=["2048x8192", "8192x2048", "2048x2048"],
                    help="out x in of each weight")
    ap.add_argument("--pool-mib", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--formats", nargs="*", help="only rows whose label starts with one of these")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    kernels = resolve("cpu").kernels
    print(machine_line(args.threads[-1]))
    with open("/proc/loadavg") as f:
        print("load average (1, 5, 15 min):", " ".join(f.read().split()[:3]))
    rows = [(label, maker) for label, maker in _candidates(kernels)
            if not args.formats or any(label.startswith(p) for p in args.formats)]
    results: dict[tuple[str, int, tuple[int, int]], float | None] = {}
    copy, drift, clock = {}, {}, CLOCKS[args.clock]
    bandwidth = (lambda: measure().bandwidth_gbs) if args.clock == "wall" else \
        (lambda: copy_gbs(clock))
    print(f"clock: {args.clock}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        before = bandwidth()
        for label, maker in rows:
            for shape in shapes:
                results[label, threads, shape] = gbs(maker, *shape, args.pool_mib << 20,
                                                     args.rounds, clock)
        after = bandwidth()
        copy[threads], drift[threads] = (before + after) / 2, (before, after)
    cols = [(t, s) for t in args.threads for s in shapes]
    head = " | ".join(f"{s[0]}x{s[1]} t{t}" for t, s in cols)
    print(f"\n| format | {head} |")
    print("|---|" + "---|" * len(cols))
    print("| copy (probe; before, after) | " + " | ".join(
        f"{copy[t]:.1f} ({drift[t][0]:.1f}, {drift[t][1]:.1f})" for t, _ in cols) + " |")
    worst = []
    for label, _ in rows:
        cells = []
        for t, s in cols:
            v = results[label, t, s]
            if v is None:
                cells.append("n/a")
                continue
            cells.append(f"{v:.1f} ({v / copy[t]:.0%})")
            worst.append((v / copy[t], label, t, s))
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\nGB/s of weight bytes read (percent of copy bandwidth; target {TARGET:.0%}).")
    for frac, label, t, s in sorted(worst)[:5]:
        print(f"  furthest: {label} at {s[0]}x{s[1]}, {t} thread(s): {frac:.0%}")


if __name__ == "__main__":
    main()
