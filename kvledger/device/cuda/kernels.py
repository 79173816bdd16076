"""The CUDA device's kernels (:class:`kvledger.device.Kernels`): the Triton kernels of
:mod:`.triton_kernels`, compiled by Triton on first launch, with the adapters the engine calls
(the paged-attention kernel behind ``paged-native``, the int KV encoder, the ``int8`` weight
format's product). What has no Triton kernel yet is None (the ``w8a8`` / ``w4a8`` / GGUF
products) or PyTorch (the fused ops), and the caller takes its PyTorch path.

Tensors the kernels take: CUDA tensors, or CPU tensors while ``TRITON_INTERPRET=1`` (Triton's
interpreter: how the tests run them here).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from pathlib import Path

import torch

from kvledger.device.ops import TorchOps

SOURCES = Path(__file__).resolve().parent / "triton_kernels"


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def runs_on(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors (CUDA ones; CPU ones when interpreting)."""
    return all(t.is_cuda or (interpreting() and t.device.type == "cpu") for t in tensors)


def fp8_capable(t: torch.Tensor) -> bool:
    """Whether the kernels can cast ``t``'s device to and from e4m3: an sm_89+ GPU (H100, L40,
    Ada; Triton does not lower the cast for an A100), or the interpreter on the CPU."""
    return not t.is_cuda or torch.cuda.get_device_capability(t.device) >= (8, 9)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _module(name: str):
    return importlib.import_module(f"kvledger.device.cuda.triton_kernels.{name}")


class TritonPagedKernel:
    """``paged-native``'s kernel on this device (the interface of the CPU's ``PagedKernel``):
    full-precision pools, and int8/int4/int2 and fp8 pools without outlier channels or
    multi-block key groups (those are read by ``paged-torch``)."""

    def __init__(self, compute_units: int) -> None:
        self.compute_units = compute_units
        self._attend = _module("paged_attention")

    def accepts(self, q: torch.Tensor, key_blocks: torch.Tensor) -> bool:
        """Whether the kernel takes these queries and blocks: float, one dtype, its device."""
        return (q.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and key_blocks.dtype == q.dtype and key_blocks.stride(-1) == 1
                and runs_on(q, key_blocks))

    def accepts_quantized(self, q: torch.Tensor, store) -> bool:
        """Whether the kernel reads this QuantizedKVStore for these queries: its compute dtype,
        its device, power-of-two block size and head_dim."""
        return (q.dtype == store.compute_dtype and runs_on(q, store.residual_of)
                and _pow2(store.block_size) and _pow2(q.shape[-1]))

    def kv_side(self, parts: dict[str, torch.Tensor], residual: torch.Tensor, *, kind: str,
                bits: int, group: int, group_blocks: int = 1,
                channels: torch.Tensor | None = None, rotation: torch.Tensor | None = None,
                group_members: torch.Tensor | None = None):
        """(the kernel's view of one codec's tensors, ``QuantizedSide``, the tensors it holds);
        None for what it does not read yet: outlier channels, keys grouped over several blocks,
        int3, shapes not powers of two, fp8 before sm_89, a field not contiguous (the caller then takes
        ``paged-torch``)."""
        _, bs, _, dim = residual.shape
        shape_ok = (self._attend.kv_int.accepts(bs, dim, bits, group) if kind == "int"
                    else _pow2(bs) and _pow2(dim) and fp8_capable(parts["codes"]))
        if (channels is not None or group_blocks > 1 or not shape_ok
                or not all(t.is_contiguous() for t in (*parts.values(), residual))):
            return None
        side = self._attend.QuantizedSide(kind, bits, group, parts["codes"], parts["scale"],
                                          parts.get("zero"), residual, rotation)
        return side, [*parts.values(), residual]

    reads_step_blocks = False
    """``quantized`` takes no staged blocks: a prefill step over a lossy pool is attended by
    ``paged-torch`` (``PagedNativeBackend.attend``)."""

    def quantized(self, q: torch.Tensor, sides, residual_of: torch.Tensor, block_size: int,
                  kv_heads: int, paged, scale: float | None = None, window: int | None = None,
                  sinks: torch.Tensor | None = None, softcap: float | None = None
                  ) -> torch.Tensor:
        """Output [N, heads, D] of q over a quantized pool (``sides``: K's and V's
        :meth:`kv_side`); rows stored rotated by R are read with q R, the output turned back
        by R^T; scores soft-capped to ``softcap`` when given."""
        keys, values = sides
        dtype, rotation = q.dtype, keys.rotation
        if rotation is not None:
            q = (q.float() @ rotation).to(dtype)
        tables = paged.block_tables
        splits = self._attend.choose_splits(q.shape[0], kv_heads, tables.shape[1],
                                            self.compute_units)
        out = self._attend.paged_attention_quantized(
            q, keys, values, residual_of, block_size, tables, paged.seq_of_query,
            paged.context_lens, q.shape[-1] ** -0.5 if scale is None else scale, window, softcap,
            sinks, splits)
        return out if rotation is None else (out.float() @ rotation.T).to(dtype)

    def __call__(self, q: torch.Tensor, key_blocks: torch.Tensor, value_blocks: torch.Tensor,
                 paged, scale: float | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None, softcap: float | None = None
                 ) -> torch.Tensor:
        """Output [N, heads, D] of q over K/V blocks [blocks, bs, kv_heads, D] as ``paged``
        (``PagedQueries``) says, scores soft-capped to ``softcap`` when given; split-KV chosen
        to fill the compute units."""
        tables = paged.block_tables
        splits = self._attend.choose_splits(q.shape[0], key_blocks.shape[2], tables.shape[1],
                                            self.compute_units)
        return self._attend.paged_attention(
            q, key_blocks, value_blocks, tables, paged.seq_of_query, paged.context_lens,
            q.shape[-1] ** -0.5 if scale is None else scale, window, softcap, sinks, splits)


class TritonIntEncoder:
    """The int KV block encoder (``Kernels.kv_encoder``: the interface of the CPU's)."""

    def __init__(self) -> None:
        self._int = _module("kv_int")

    def encode_into(self, blocks: torch.Tensor, parts: dict[str, torch.Tensor],
                    block_ids: torch.Tensor, *, bits: int, group: int, centred: bool,
                    min_scale: float, channels: torch.Tensor | None = None) -> bool:
        """Quantize ``blocks`` [n, bs, kv_heads, D] and write each field at ``block_ids``
        (the outlier ``channels`` [kv_heads, n_out] kept in fp16, gathered in PyTorch);
        False, writing nothing, for a shape, dtype or device the kernel does not take."""
        _, bs, _, dim = blocks.shape
        if (not self._int.accepts(bs, dim, bits, group) or not runs_on(blocks, *parts.values())
                or not all(t.is_contiguous() for t in parts.values())):
            return False
        blocks = blocks.contiguous()
        if channels is not None:
            index = channels.to(blocks.device)[None, None].expand(*blocks.shape[:2], -1, -1)
            parts["outliers"][block_ids] = blocks.gather(-1, index).half()
            blocks = blocks.scatter(-1, index, 0.0)
        self._int.encode_into(blocks, parts, block_ids.to(blocks.device), bits=bits,
                              group=group, centred=centred, min_scale=min_scale)
        return True


class CudaKernels:
    """The CUDA device's :class:`kvledger.device.Kernels`."""

    def __init__(self, compute_units=lambda: 1) -> None:
        self._units = compute_units

    def library(self):
        """The Triton kernels' package, or None when triton is not installed."""
        if self.why_unavailable():
            return None
        return importlib.import_module("kvledger.device.cuda.triton_kernels")

    def why_unavailable(self) -> str:
        """'' when triton is importable, else how to install it."""
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install -e '.[cuda]')"
        return ""

    def source_digest(self) -> str:
        """Short hash of the Triton kernels' sources."""
        text = b"\0".join(p.read_bytes() for p in sorted(SOURCES.glob("*.py")))
        return hashlib.sha256(text).hexdigest()[:16]

    def paged_attention(self) -> TritonPagedKernel | None:
        """The Triton paged-attention kernel (None without triton)."""
        return None if self.library() is None else TritonPagedKernel(self._units())

    def w8a8(self) -> None:
        """None: no Triton int8-activation matmul yet (``w8a8`` weights fall back)."""
        return

    def int8_weights(self):
        """The Triton int8 weight-only product (``triton_kernels/linear_int8.py``; None
        without triton)."""
        return None if self.library() is None else _module("linear_int8").int8_matmul

    def kquant(self) -> None:
        """None: no Triton GGUF-block products yet (``kquant-*`` weights dequantize)."""
        return

    def kv_encoder(self) -> TritonIntEncoder | None:
        """The Triton int KV encoder (None without triton)."""
        return None if self.library() is None else TritonIntEncoder()

    def state_mixers(self) -> None:
        """None: no Triton state-mixer steps yet (the mixers step in PyTorch)."""
        return

    def fused_ops(self, max_rows: dict | None = None) -> TorchOps:
        """The PyTorch ops: no fused Triton ops yet."""
        return TorchOps()
