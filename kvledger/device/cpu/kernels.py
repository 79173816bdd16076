"""The CPU's kernels (:class:`kvledger.device.Kernels`): one shared library of C++ kernels,
built on first use by :mod:`.native`, with a handle per kernel (None where it cannot be built,
``KVLEDGER_NATIVE=0`` or no compiler; the caller then takes its PyTorch path)."""

from __future__ import annotations

from kvledger.device.cpu import fused, kquant, kv_encode, native, state_steps, w8a8


class CpuKernels:
    """The CPU's :class:`kvledger.device.Kernels`."""

    def library(self):
        """:func:`kvledger.device.cpu.native.library`."""
        return native.library()

    def why_unavailable(self) -> str:
        """:func:`kvledger.device.cpu.native.why_unavailable`."""
        return native.why_unavailable()

    def source_digest(self) -> str:
        """:func:`kvledger.device.cpu.native.source_digest`."""
        return native.source_digest()

    def paged_attention(self) -> native.PagedKernel | None:
        """:func:`kvledger.device.cpu.native.load`."""
        return native.load()

    def w8a8(self) -> w8a8.W8A8Kernel | None:
        """:func:`kvledger.device.cpu.w8a8.kernel`."""
        return w8a8.kernel()

    def int8_weights(self) -> None:
        """None: the ``int8`` format's product is ``aten._weight_int8pack_mm``."""
        return

    def kquant(self) -> kquant.KQuantKernel | None:
        """:func:`kvledger.device.cpu.kquant.kernel`."""
        return kquant.kernel()

    def kv_encoder(self) -> kv_encode.NativeIntEncoder | None:
        """:func:`kvledger.device.cpu.kv_encode.encoder`."""
        return kv_encode.encoder()

    def state_mixers(self) -> state_steps.StateStepKernel | None:
        """:func:`kvledger.device.cpu.state_steps.kernel`."""
        return state_steps.kernel()

    def fused_ops(self, max_rows=None):
        """:func:`kvledger.device.cpu.fused.fused_ops`."""
        return fused.fused_ops(max_rows)


KERNELS = CpuKernels()
