"""The kernel probe's timing (:mod:`.probe` chooses from what this measures).

Each timing runs on random inputs of the model's real shapes: one decode row per format of a
matmul shape class (bf16 activations, each call on a weight evicted from the caches, as in a
decode step, which streams every layer's weights from memory), each format's own kernel against
the many-row GEMM paths (fp32, bf16) at :data:`GEMM_ROWS` rows, one decode query over
:data:`ATTENTION_CONTEXT` positions per attention backend (over a bf16 or an int8 pool), and
the device's fused element-wise ops (``Kernels.fused_ops``) against PyTorch's at
:data:`FUSED_ROWS` rows.
Candidates are timed in interleaved rounds (each round calls every candidate once, after a
warm-up) and each keeps its best of ``REPEATS`` rounds, in microseconds: on a shared machine a
disturbed moment then slows all candidates alike instead of one of them.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvledger.device import Kernels
from kvledger.device.ops import TorchOps
from kvledger.model.kquant import NATIVE_FORMATS, KQuantLinear, random_matrix
from kvledger.model.linear import (
    FORMATS,
    GEMM_PATHS,
    KQUANT_FORMATS,
    Q4_FORMATS,
    Linear,
    int4_shape_ok,
)
from kvledger.spec import ModelSpec

REPEATS = 20
ATTENTION_CONTEXT = 512
GEMM_ROWS = (16, 64, 256)
"""Row counts at which the probe times each layer format's own kernel against the GEMM paths
(:meth:`kvledger.model.linear.Linear.gemm`): prefill chunks and large decode batches."""
GEMM_REPEATS = 3
EVICT_BYTES_MIN = 64 << 20
"""Least bytes read between two timed decode rows to push the weight out of the caches (the
probe reads twice the last-level cache when the OS reports its size, and at least this)."""
FUSED_ROWS = (1, 4, 16, 64, 256, 1024)
"""Row counts at which the probe times each fused op, native against PyTorch."""
FUSED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def best_us(candidates: dict, repeats: int = REPEATS, before=None) -> dict[str, float]:
    """Best time of each ``name -> fn`` over interleaved rounds, µs; ``before()``, if given,
    runs untimed before every timed call."""
    best = dict.fromkeys(candidates, float("inf"))
    for fn in candidates.values():
        fn()
    for _ in range(repeats):
        for name, fn in candidates.items():
            if before is not None:
                before()
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: round(t * 1e6, 1) for name, t in best.items()}


def _layers(out_f: int, in_f: int, kernels: Kernels) -> dict[str, Linear]:
    """One Linear per format of a random [out_f, in_f] weight on the device's ``kernels``
    (int4 where its shape allows; the native ``kquant`` paths on Q4_K blocks where the width
    is whole super-blocks)."""
    gen = torch.Generator().manual_seed(0)
    dense = (torch.randn(out_f, in_f, generator=gen) * 0.02).bfloat16()
    q4 = None
    if int4_shape_ok(out_f, in_f):
        q4 = (torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8),
              torch.full((out_f, in_f // 32), 0.01), torch.zeros(out_f, in_f // 32))
    layers = {fmt: Linear(dense, None, q4, fmt, kernels=kernels) for fmt in FORMATS
              if fmt not in Q4_FORMATS + KQUANT_FORMATS or (fmt in Q4_FORMATS and q4 is not None)}
    if in_f % 256 == 0:
        blocks = random_matrix("Q4_K", out_f, in_f, gen)
        layers.update({fmt: KQuantLinear([blocks], None, fmt, kernels) for fmt in NATIVE_FORMATS})
    return {fmt: lin for fmt, lin in layers.items() if lin.format == fmt}  # native ones built


def last_level_cache_bytes() -> int | None:
    """Size of CPU 0's largest-level cache in bytes, from Linux sysfs (None elsewhere)."""
    sizes = {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes[level] = int(text.rstrip("KMG")) * unit
    return sizes[max(sizes)] if sizes else None


def evictor():
    """A call that reads :data:`EVICT_BYTES_MIN` or twice the last-level cache, whichever is
    more, so the next matmul finds its weight in memory, not in a cache."""
    nbytes = max(EVICT_BYTES_MIN, 2 * (last_level_cache_bytes() or 0))
    buffer = torch.ones(nbytes // 4)
    return lambda: buffer.sum()


def time_formats(out_f: int, in_f: int, kernels: Kernels, evict) -> dict[str, float]:
    """Format -> best time of one bf16 decode row through an [out_f, in_f] weight, µs;
    ``evict()`` (:func:`evictor`) runs before every timed call."""
    x = torch.randn(1, in_f).bfloat16()
    return best_us({fmt: lambda lin=lin: lin(x) for fmt, lin in _layers(out_f, in_f, kernels).items()},
                    before=evict)


def time_gemm(out_f: int, in_f: int, kernels: Kernels
              ) -> dict[str, dict[str, dict[str, float]]]:
    """Format -> rows (as text, :data:`GEMM_ROWS`) -> ``{"own": µs, path: µs, ...}`` through
    an [out_f, in_f] weight, for each of :data:`kvledger.model.linear.GEMM_PATHS` that is not
    the format's own kernel (none for int4; no ``bf16`` for dense, whose own kernel it is)."""
    result: dict[str, dict[str, dict[str, float]]] = {}
    for fmt, lin in _layers(out_f, in_f, kernels).items():
        paths = [] if fmt == "int4" else [p for p in GEMM_PATHS if not (
            fmt == "dense" and GEMM_PATHS[p] == lin.weight.dtype)]
        for rows in GEMM_ROWS:
            x = torch.randn(rows, in_f).bfloat16()
            calls = {"own": lambda lin=lin, x=x: lin(x)}
            for path in paths:
                calls[path] = lambda lin=lin, x=x, path=path: lin.gemm(x, path)
            result.setdefault(fmt, {})[str(rows)] = best_us(calls, GEMM_REPEATS)
    return result


def _pool(spec: ModelSpec, kernels: Kernels, quantized: bool):
    """A one-layer pool of ATTENTION_CONTEXT positions: bf16, or int8 (bf16 compute) filled
    with random K/V (all blocks full, so every one is read quantized)."""
    from kvledger.engine.kv.codecs import make_codecs
    from kvledger.engine.kv.quantized_store import QuantizedKVStore
    from kvledger.engine.kv.store import KVStore

    block, dims = 16, (spec.num_kv_heads, spec.head_dim)
    blocks = ATTENTION_CONTEXT // block
    if not quantized:
        return KVStore(1, blocks, block, *dims, torch.bfloat16)
    keys, values = make_codecs("int8", block, *dims, spec.head_dim, "per-channel")
    store = QuantizedKVStore(1, blocks, block, *dims, "int8", keys, values, torch.bfloat16, 1,
                             kernels)
    kv = torch.randn(ATTENTION_CONTEXT, *dims).bfloat16()
    store.write(0, torch.arange(ATTENTION_CONTEXT), kv, kv)
    return store


def time_attention(spec: ModelSpec, kernels: Kernels, quantized: bool = False
                   ) -> dict[str, float]:
    """Backend -> best time of one decode query over :data:`ATTENTION_CONTEXT` positions of a
    bf16 pool (an int8 one when ``quantized``) on the device's ``kernels``, µs; backends
    unavailable there are left out."""
    from kvledger.engine.attention import BACKENDS, AttentionMetadata, make_backend
    from kvledger.engine.attention.metadata import DecodeGroup

    store = _pool(spec, kernels, quantized)
    q = torch.randn(1, spec.num_attention_heads, spec.head_dim).bfloat16()
    slots = torch.arange(ATTENTION_CONTEXT)[None]
    empty = q[:0, :spec.num_kv_heads]
    candidates = {}
    for name in BACKENDS:
        backend = make_backend(name, kernels)
        if backend.name != name:
            continue  # the device has no kernel for it
        meta = AttentionMetadata(None, decodes=[DecodeGroup(0, 1, slots, None)])
        candidates[name] = lambda b=backend, m=meta: b(0, q, empty, empty, m, store)
    return best_us(candidates)


GLU_OPS = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}
"""The MLP activation (``ModelSpec.mlp.act``) -> its fused gated op in the device's ops."""


def glu_op(spec: ModelSpec) -> str:
    """The fused gated-activation op the model's MLP calls (SiLU for any other name)."""
    return GLU_OPS.get(spec.mlp.act, "silu_mul")


def _fused_call(ops, op: str, rows: int, dtype: torch.dtype, spec: ModelSpec, gen):
    """A call of ``ops``' ``op`` on ``rows`` random rows of the model's width."""
    if op in GLU_OPS.values():
        x = torch.randn(rows, 2 * spec.intermediate_size, generator=gen).to(dtype)
        return lambda: getattr(ops, op)(x)
    h = torch.randn(rows, spec.hidden_size, generator=gen).to(dtype)
    delta = (torch.randn(rows, spec.hidden_size, generator=gen) * 1e-3).to(dtype)
    weight = torch.randn(spec.hidden_size, generator=gen).to(dtype)
    return lambda: ops.add_rms_norm(h, delta, weight, 1e-5)


def time_fused(spec: ModelSpec, kernels: Kernels) -> dict[str, dict[str, dict[str, float]]]:
    """``"op:dtype"`` -> rows (as text, :data:`FUSED_ROWS`) -> ``{"native": µs, "torch": µs}``
    of the device's fused ops (no row limit) and PyTorch's on rows of the model's width; empty
    where the device has no compiled kernels."""
    if kernels.library() is None:
        return {}
    impls = {"native": kernels.fused_ops(), "torch": TorchOps()}
    gen = torch.Generator().manual_seed(0)
    result = {}
    for name, dtype in FUSED_DTYPES.items():
        for op in ("add_rms_norm", glu_op(spec)):
            result[f"{op}:{name}"] = {
                str(rows): best_us({k: _fused_call(o, op, rows, dtype, spec, gen)
                                     for k, o in impls.items()})
                for rows in FUSED_ROWS}
    return result

