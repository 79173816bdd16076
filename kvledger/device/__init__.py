"""The device seam: what the engine and the model families ask of the hardware they run on.

A device answers, for a model (:class:`Device`): which attention backend runs it, which weight
format each matmul shape class holds (and from how many rows a GEMM path takes over), which
fused element-wise ops its layers call; and through its :class:`Kernels`: which KV block
encoder the quantized store uses, and how its kernels are built or loaded. Every answer has a
PyTorch fallback (a kernel that cannot be had is None), so a device without a compiler still
runs every model.

The two objects are layered so the import graph stays acyclic: :class:`Kernels` sits below the
code that calls a kernel (a Linear's weight format, the quantized KV store), and
:class:`Device` above it, since choosing measures those callers (the CPU's kernel probe times
the engine's own layers and attention backends). The CPU is :mod:`kvledger.device.cpu`
(``kvledger.device.cpu.device.CPU``); another device is a sibling folder with objects of the
same shape.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvledger.model.ops import TorchOps
    from kvledger.spec import ModelSpec


@runtime_checkable
class Kernels(Protocol):
    """A device's compiled kernels: how they are built or loaded, and each one's handle."""

    def library(self) -> object | None:
        """The compiled kernels, built or loaded once; None (logged) when they cannot be."""

    def why_unavailable(self) -> str:
        """Why :meth:`library` is None ('' when it is not)."""

    def w8a8(self) -> object | None:
        """The int8-activation matmul behind the ``w8a8`` / ``w4a8`` weight formats
        (:mod:`kvledger.model.linear`), or None: those formats then fall back."""

    def kquant(self) -> object | None:
        """The products with weights in a GGUF's own blocks behind the ``kquant-*`` weight
        formats (:mod:`kvledger.model.kquant`), and their dequantization, or None: those
        formats then dequantize in PyTorch."""

    def kv_encoder(self) -> object | None:
        """The int8 / int4 KV block encoder (``encode_into``: a codec's bytes written at block
        ids in one call), or None: the codecs' PyTorch code encodes."""

    def fused_ops(self, max_rows: dict | None = None) -> TorchOps:
        """The fused element-wise ops, each taking at most ``max_rows`` (op -> dtype -> rows)
        and leaving more to the PyTorch ones; the PyTorch ones where none are built."""

    def release_thread_pool(self) -> bool:
        """Free the calling thread's worker threads before another thread takes over the
        computing; True when something was freed."""


@runtime_checkable
class Device(Protocol):
    """What the engine and a model family ask of the device they run on."""

    name: str
    kernels: Kernels

    def attention_backend(self, spec: ModelSpec, quantized: bool = False) -> str:
        """Which attention backend (a name of ``kvledger.engine.attention.BACKENDS``) runs
        ``spec``, over quantized KV blocks when ``quantized``."""

    def weight_formats(self, spec: ModelSpec, q4_classes: set[str],
                       kquant_classes: set[str] = frozenset()) -> dict[str, str]:
        """Which weight format (``kvledger.model.linear.FORMATS``) each matmul shape class of
        ``spec`` holds; ``q4_classes``: the classes the checkpoint stores as Q4;
        ``kquant_classes``: those it holds as a K-quant GGUF's blocks."""

    def gemm_paths(self, spec: ModelSpec, formats: dict[str, str]
                   ) -> dict[str, tuple[int, str] | None]:
        """Class -> (rows, path): from how many rows its layers (in ``formats``) multiply on
        the weight dequantized per call (``kvledger.model.linear.GEMM_PATHS``); None: never."""

    def fused_ops(self, spec: ModelSpec) -> TorchOps:
        """The fused element-wise ops ``spec``'s layers call."""
