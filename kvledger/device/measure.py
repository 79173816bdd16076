"""Measure this machine as the ``local`` device: memory, memory bandwidth, matmul throughput.

Bandwidth: the best of several copies of a large buffer, counting every byte read and written
(``2 x nbytes`` per copy; STREAM's "copy" kernel convention). Throughput: the best of several
square bf16 matmuls (fp32 where bf16 is unsupported, or slower than fp32 on a CPU), ``2 x n^3``
FLOPs each. Memory: the GPU's total memory, or the host's physical RAM on a CPU. Figures are peaks (best of ``repeats``), the
same kind of number as a datasheet's.

The result is a :class:`kvledger.ledger.hardware.Device` (the planner's datasheet figures); torch
is imported inside the measuring functions only.
"""

from __future__ import annotations

import os
import platform
import time

from kvledger.ledger.hardware import Device, GiB


def _best_seconds(fn, sync, repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _matmul_side(dtype, largest: int, budget_s: float = 0.25) -> int:
    """The largest power-of-two side <= ``largest`` (from 256) whose square CPU matmul in
    ``dtype`` takes under ``budget_s`` seconds, so that the probe stays short where the dtype
    is slow. Each side is run once untimed first (oneDNN's first call sets up its kernels)."""
    import torch

    n = 256
    while n < largest:
        a = torch.randn(n, n).to(dtype)
        a @ a
        t0 = time.perf_counter()
        a @ a
        if (time.perf_counter() - t0) * 8 > budget_s:  # the next side costs 8x
            break
        n *= 2
    return n


def _faster_cpu_dtype():
    """bf16 or fp32, whichever multiplies two 256 x 256 matrices faster here: a CPU without
    bf16 instructions emulates bf16 matmuls at a small fraction of its fp32 rate, and the
    engine then computes in fp32 GEMMs (its kernel probe), so fp32 is this CPU's peak."""
    import torch

    def seconds(dtype) -> float:
        a = torch.randn(256, 256).to(dtype)
        return _best_seconds(lambda: a @ a, lambda: None, 3)

    return torch.bfloat16 if seconds(torch.bfloat16) <= seconds(torch.float32) else torch.float32


def measure(buffer_mib: int = 512, matmul_n: int | None = None, repeats: int = 5) -> Device:
    """Measure the current accelerator (CUDA if available, else the CPU) as a ``local`` Device.

    Args:
        buffer_mib: size of the copied buffer, MiB (bigger than the caches).
        matmul_n: side of the square matmul (default 8192 on a GPU; on a CPU the largest
            power of two up to 2048 whose matmul takes under a quarter of a second).
        repeats: timed repetitions; the best one counts.
    """
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    nbytes = buffer_mib * 2**20
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bandwidth_gbs = 2 * nbytes / _best_seconds(lambda: dst.copy_(src), sync, repeats) / 1e9
    src = dst = None  # free the buffers before the matmul

    if cuda:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    else:
        dtype = _faster_cpu_dtype()
    n = matmul_n or (8192 if cuda else _matmul_side(dtype, 2048))
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    mm_s = _best_seconds(lambda: a @ b, sync, repeats)
    tflops = 2 * n**3 / mm_s / 1e12

    if cuda:
        props = torch.cuda.get_device_properties(0)
        memory, what = props.total_memory, props.name
    else:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        what = (
            f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
        )
    source = f"measured by kvledger probe on {what} ({dtype}, {time.strftime('%Y-%m-%d')})"
    return Device("local", memory / GiB, bandwidth_gbs, tflops, source)


def available_memory_bytes() -> int:
    """Bytes of host memory available now without swapping: ``MemAvailable`` of
    ``/proc/meminfo`` (Linux: free memory plus what the kernel can reclaim), else the free
    physical pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
