"""Build and load the native kernels through ctypes, all from ``csrc/``: paged attention
(``paged_attention.cpp`` and the ``paged_*.h`` it includes), the fused element-wise ops
(``fused_ops.cpp``, :mod:`kvledger.device.cpu.fused`), the decode products with int8
activations (``int8_gemv.cpp`` and the headers it includes, :mod:`kvledger.device.cpu.w8a8`),
the bf16 dequantization of their weights for a prefill's GEMM (``dequant_bf16.cpp``, also
:mod:`kvledger.device.cpu.w8a8`), the products with weights in GGUF's own K-quant and 32-weight
blocks and their dequantization (``kquant_gemv.cpp`` and its ``kquant_*.h``,
:mod:`kvledger.device.cpu.kquant`), the int8 / int4 KV block encoder (``int_encode.cpp``,
:mod:`kvledger.device.cpu.kv_encode`) and the decode steps of the state mixers
(``state_steps.cpp``, :mod:`kvledger.device.cpu.state_steps`).

The sources make one plain shared library (no Python or torch headers), built on first use with
the system C++ compiler (``$CXX``, else ``c++`` / ``g++``) as ``-O3 -march=native -fopenmp``
(its OpenMP loops run on the runtime PyTorch already loaded, libgomp.so.1), into
``cache_dir()/native/kvledger_native-<key>.so``. The key hashes the sources, the compiler's
version line, the flags and the CPU (model name and flags from ``/proc/cpuinfo``), so another
CPU or compiler rebuilds instead of loading code it cannot run. A build takes a few seconds.

When it cannot be built (no compiler, a failing build, ``KVLEDGER_NATIVE=0``), :func:`library`
returns None and logs one warning; the engine then uses the PyTorch attention backend and
PyTorch ops for the fused ones.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

from kvledger.paths import cache_dir

log = logging.getLogger("kvledger.engine")
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fopenmp"]
SOURCES = ("paged_attention.cpp", "paged_vec.h", "paged_softmax.h", "paged_plain.h",
           "paged_quantized.h", "fused_ops.cpp", "int8_gemv.cpp", "int8_activations.h",
           "gemv_tiles.h", "interleaved_gemv.h", "dequant_bf16.cpp", "int_encode.cpp",
           "kquant_gemv.cpp", "kquant_blocks.h", "kquant_activations.h", "kquant_scalar.h",
           "kquant_avx2.h", "kquant_avx512.h", "state_steps.cpp")
"""Every source the library is built from, in ``csrc/`` beside this module: the ``.cpp`` files
are compiled, the ``.h`` files they include are written beside them (one folder, so the names
are unique), and all of them are hashed, in this order, into the build and probe keys."""
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
"""The element types every native kernel takes, as the int code its ``dtype`` argument reads."""
_reason: list[str] = []


class NativeUnavailable(RuntimeError):
    """The native kernel could not be built or loaded (the message says why)."""


def cpu_identity() -> str:
    """CPU model name and feature flags (from /proc/cpuinfo where there is one)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', platform.machine())} | {fields.get('flags', '')}"


def _sources() -> list[tuple[str, bytes]]:
    folder = resources.files(__package__).joinpath("csrc")
    return [(name, folder.joinpath(name).read_bytes()) for name in SOURCES]


def source_digest() -> str:
    """Short hash of the kernels' sources and build flags (a new kernel is a new probe key)."""
    text = b"\0".join([src for _, src in _sources()] + [" ".join(FLAGS).encode()])
    return hashlib.sha256(text).hexdigest()[:16]


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _build(cxx: str, sources: list[tuple[str, bytes]]) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=30, check=False).stdout.splitlines()[:1]
    key = hashlib.sha256(b"\0".join([src for _, src in sources] + [
        " ".join(FLAGS + version).encode(), cpu_identity().encode()])).hexdigest()[:16]
    target = cache_dir() / "native" / f"kvledger_native-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        paths = []
        for name, src in sources:
            paths.append(Path(tmp) / name)
            paths[-1].write_bytes(src)
        out = Path(tmp) / "kernel.so"
        units = [str(p) for p in paths if p.suffix == ".cpp"]
        done = subprocess.run([cxx, *FLAGS, *units, "-o", str(out)],
                              capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise NativeUnavailable(f"{cxx} failed: {done.stderr.strip()[-400:]}")
        os.replace(out, target)
    log.info("built the native kernels: %s", target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The native library, built if needed; None (with one logged warning) when it cannot be."""
    if os.environ.get("KVLEDGER_NATIVE", "1") == "0":
        _reason.append("disabled by KVLEDGER_NATIVE=0")
        log.warning("native kernels off (KVLEDGER_NATIVE=0); using PyTorch ops instead")
        return None
    cxx = _compiler()
    try:
        if cxx is None:
            raise NativeUnavailable("no C++ compiler (set CXX or install g++)")
        return ctypes.CDLL(str(_build(cxx, _sources())))
    except (NativeUnavailable, OSError, subprocess.SubprocessError) as exc:
        _reason.append(str(exc))
        log.warning("native kernels unavailable (%s); using PyTorch ops instead", exc)
        return None


@functools.cache
def load() -> PagedKernel | None:
    """The paged-attention kernel, or None when the library cannot be built."""
    lib = library()
    return None if lib is None else PagedKernel(lib)


def why_unavailable() -> str:
    """Why :func:`load` returned None ('' if it did not)."""
    return _reason[-1] if _reason else ""


class KVSide(ctypes.Structure):
    """K or V of one layer of a quantized store, as the kernel reads it (``KVSide`` in the
    .cpp): pointers to the codec tensors and the residual buffers, and the codec's kind."""

    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("zero", ctypes.c_void_p), ("outliers", ctypes.c_void_p),
                ("outlier_channels", ctypes.c_void_p), ("residual", ctypes.c_void_p),
                ("rotation", ctypes.c_void_p), ("kind", ctypes.c_int32), ("group", ctypes.c_int32),
                ("num_outliers", ctypes.c_int32), ("group_members", ctypes.c_void_p),
                ("group_blocks", ctypes.c_int32)]


INT_KINDS = {8: 8, 4: 4, 3: 7, 2: 2}
"""KVSide.kind of an integer codec, by bits (``Kind`` in ``paged_quantized.h``; 3 is e4m3's)."""


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class PagedKernel:
    """ctypes wrapper of ``kvl_paged_attention`` (see the .cpp for the layout)."""

    # below this many (query, kv head, position) triples one thread beats starting a second
    THREAD_WORK = 1 << 13
    reads_step_blocks = True
    """:meth:`quantized` takes a step's staged blocks (``step``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvl_paged_attention
        i32, ptr = ctypes.c_int, ctypes.c_void_p
        self._fn.argtypes = ([ptr] * 7 + [i32] * 6 + [ctypes.c_float, i32, i32, i32, i32]
                             + [ptr] * 5 + [ctypes.c_float])
        self._fn.restype = None
        self.max_group, self.max_dim = lib.kvl_max_group(), lib.kvl_max_head_dim()
        self.dim_multiple = lib.kvl_head_dim_multiple()
        self.max_block = lib.kvl_max_block_size()

    @staticmethod
    def kv_side(parts: dict[str, torch.Tensor], residual: torch.Tensor, *, kind: str, bits: int,
                group: int, group_blocks: int = 1, channels: torch.Tensor | None = None,
                rotation: torch.Tensor | None = None, group_members: torch.Tensor | None = None
                ) -> tuple[KVSide, list[torch.Tensor]] | None:
        """The kernel's view of one codec's tensors ``parts`` (a quantized store's key or value
        parts of one layer), residual buffers [slots, bs, kv_heads, D], the fp32 rotation [D, D]
        the rows are stored by and, for keys grouped over ``group_blocks`` blocks, the blocks of
        each block's group, with the tensors it points into (keep them alive); None for a layout
        the kernel does not read.

        The codec comes as its numbers: ``kind`` ``"int"`` (``bits``-bit codes, a scale and zero
        point per ``group`` elements along D, 0: per channel) or ``"fp8"`` (e4m3 codes, a scale
        per block and head), ``channels`` [kv_heads, n] long: outlier channels kept in fp16."""
        kind_code = 3 if kind == "fp8" else INT_KINDS[bits]
        members = group_members if group_blocks > 1 else None
        if rotation is not None and rotation.dtype != torch.float32:
            return None
        held = [t for t in (*parts.values(), residual, channels, rotation, members) if t is not None]
        if not all(t.is_contiguous() for t in held):
            return None
        side = KVSide(_ptr(parts["codes"]), _ptr(parts["scale"]), _ptr(parts.get("zero")),
                      _ptr(parts.get("outliers")), _ptr(channels), _ptr(residual), _ptr(rotation),
                      kind_code, group, 0 if channels is None else channels.shape[1], _ptr(members),
                      group_blocks)
        return side, held

    def accepts(self, q: torch.Tensor, key_blocks: torch.Tensor) -> bool:
        """Whether the kernel handles this dtype and these sizes."""
        _, block_size, kv_heads, dim = key_blocks.shape
        return (q.dtype in DTYPE_CODES and key_blocks.dtype == q.dtype and key_blocks.is_contiguous()
                and q.shape[1] // kv_heads <= self.max_group and dim <= self.max_dim
                and dim % self.dim_multiple == 0
                and block_size <= self.max_block)

    def accepts_quantized(self, q: torch.Tensor, store) -> bool:
        """Whether the kernel reads this QuantizedKVStore for these queries."""
        return (q.dtype in DTYPE_CODES and store.compute_dtype == q.dtype
                and q.shape[1] // store.num_kv_heads <= self.max_group
                and q.shape[2] <= self.max_dim and q.shape[2] % self.dim_multiple == 0
                and store.block_size <= self.max_block)

    def __call__(self, q: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
                 paged, scale: float | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None, softcap: float | None = None
                 ) -> torch.Tensor:
        """Output [N, heads, D] of q [N, heads, D] over K/V blocks [blocks, bs, kv_heads, D];
        scores scaled by ``scale`` (default 1/sqrt(D)), soft-capped to ``softcap``
        ``tanh(s / softcap)`` when given, over the last ``window`` positions of each context
        when given, with the sink logits ``sinks`` [heads] in each softmax's denominator when
        given."""
        _, block_size, kv_heads, _ = key_blocks.shape
        return self._launch(q, kv_heads, block_size, paged, key_blocks.data_ptr(),
                            value_blocks.data_ptr(), None, scale, window, sinks, softcap)

    def quantized(self, q: torch.Tensor, sides: tuple[KVSide, KVSide],
                  residual_of: torch.Tensor, block_size: int, kv_heads: int,
                  paged, scale: float | None = None, window: int | None = None,
                  sinks: torch.Tensor | None = None, step=None,
                  softcap: float | None = None) -> torch.Tensor:
        """Output [N, heads, D] of q [N, heads, D] over quantized blocks: ``sides`` from
        :meth:`kv_side` for K and V, ``residual_of`` [blocks] int64 (residual slot or -1);
        ``scale``, ``window``, ``sinks`` and ``softcap`` as in :meth:`__call__`. ``step``
        (``engine.kv.store.StepBlocks``, rows as the residual buffers hold them): its blocks
        are read from its ``keys`` / ``values`` instead of the pool."""
        k_ptr = v_ptr = None
        if step is not None:
            residual_of = residual_of.clone()
            residual_of[step.ids] = -2 - torch.arange(len(step.ids))
            keys, values = step.keys.contiguous(), step.values.contiguous()
            k_ptr, v_ptr = keys.data_ptr(), values.data_ptr()
        return self._launch(q, kv_heads, block_size, paged, k_ptr, v_ptr,
                            (ctypes.byref(sides[0]), ctypes.byref(sides[1]),
                             residual_of.data_ptr()), scale, window, sinks, softcap)

    def _launch(self, q, kv_heads, block_size, paged, k_ptr, v_ptr, quant, scale,
                window, sinks, softcap) -> torch.Tensor:
        q = q.contiguous()
        sinks = None if sinks is None else sinks.float().contiguous()
        out = torch.empty_like(q)
        n, heads, dim = q.shape
        tables, seqs, lens = paged.block_tables, paged.seq_of_query, paged.context_lens
        work = n * kv_heads * tables.shape[1] * block_size
        threads = torch.get_num_threads() if work >= self.THREAD_WORK else 1
        parts, partial = self.split(n * kv_heads, tables.shape[1], threads), None
        if parts > 1:
            partial = torch.empty(n * heads * parts * (dim + 2), dtype=torch.float32)
        self._fn(q.data_ptr(), k_ptr, v_ptr, out.data_ptr(),
                 tables.data_ptr(), seqs.data_ptr(), lens.data_ptr(), n, heads, kv_heads, dim,
                 block_size, tables.shape[1], dim ** -0.5 if scale is None else scale,
                 window or 0, DTYPE_CODES[q.dtype], threads,
                 parts, None if partial is None else partial.data_ptr(), *(quant or (None,) * 3),
                 _ptr(sinks), softcap or 0.0)
        return out

    @staticmethod
    def split(pairs: int, blocks: int, threads: int) -> int:
        """Parts to cut each context into so ``pairs`` (query, kv head) items keep ``threads``
        threads evenly busy: 1 when there are enough items (or too few blocks to cut)."""
        if threads <= 1 or pairs % threads == 0 or pairs >= 4 * threads:
            return 1
        return threads if blocks >= 2 * threads else 1
