"""The CPU device (:class:`kvledger.device.Device`): its choices come from the kernel probe
(:mod:`.kernel_probe`: measured once per machine, model shapes and kernel sources, cached;
``KVLEDGER_ATTENTION``, ``KVLEDGER_WEIGHT_FORMAT`` and ``KVLEDGER_GEMM`` force them), its
kernels from :data:`kvledger.device.cpu.kernels.KERNELS`."""

from __future__ import annotations

from kvledger.device.cpu import kernel_probe
from kvledger.device.cpu.kernels import KERNELS
from kvledger.spec import ModelSpec


class CpuDevice:
    """The CPU's :class:`kvledger.device.Device`."""

    name = "cpu"
    kernels = KERNELS

    def attention_backend(self, spec: ModelSpec, quantized: bool = False) -> str:
        """:func:`kvledger.device.cpu.kernel_probe.choose_attention`."""
        return kernel_probe.choose_attention(spec, quantized)

    def weight_formats(self, spec: ModelSpec, q4_classes: set[str],
                       kquant_classes: set[str] = frozenset()) -> dict[str, str]:
        """:func:`kvledger.device.cpu.kernel_probe.choose_formats`."""
        return kernel_probe.choose_formats(spec, q4_classes, kquant_classes)

    def gemm_paths(self, spec: ModelSpec, formats: dict[str, str]
                   ) -> dict[str, tuple[int, str] | None]:
        """:func:`kvledger.device.cpu.kernel_probe.choose_gemm`."""
        return kernel_probe.choose_gemm(spec, formats)

    def fused_ops(self, spec: ModelSpec):
        """The native fused ops within the probe's row limits
        (:func:`kvledger.device.cpu.kernel_probe.fused_limits`)."""
        return self.kernels.fused_ops(kernel_probe.fused_limits(spec))


CPU = CpuDevice()
