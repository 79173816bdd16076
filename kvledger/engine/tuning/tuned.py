"""A device with the probe's choices: what the engine hands the model as ``device=``.

The device (:class:`kvledger.device.Device`) answers what it has; this object adds what was
chosen by measuring it (:mod:`.probe`: cached per machine, model shapes and kernel sources;
``KVLEDGER_ATTENTION``, ``KVLEDGER_WEIGHT_FORMAT`` and ``KVLEDGER_GEMM`` force the choices).
The engine builds one per engine, from the device its config names; a tensor-parallel worker
builds its own from the same name. A device that is not probed (``Device.probes`` False: the
CUDA device, whose probe is not written) gives its fixed ``choices`` instead, under the same
environment overrides; its GEMM paths are none and its fused ops have no row limits.
"""

from __future__ import annotations

from kvledger.device import Device, Kernels
from kvledger.engine.tuning import probe
from kvledger.spec import ModelSpec


class TunedDevice:
    """``device``'s kernels and the probe's choices on it.

    Attributes:
        device: the device (its step hook, identity, thread-pool release).
        name, kernels, torch_device: the device's.
    """

    def __init__(self, device: Device) -> None:
        self.device = device
        self.name = device.name
        self.kernels: Kernels = device.kernels
        self.torch_device = device.torch_device

    def attention_backend(self, spec: ModelSpec, quantized: bool = False) -> str:
        """Which attention backend (a name of ``kvledger.engine.attention.BACKENDS``) runs
        ``spec``, over quantized KV blocks when ``quantized``
        (:func:`kvledger.engine.tuning.probe.choose_attention`)."""
        if not self.device.probes:
            return probe.forced_attention() or self.device.choices["attention"]
        return probe.choose_attention(spec, self.device, quantized)

    def weight_formats(self, spec: ModelSpec, q4_classes: set[str],
                       kquant_classes: set[str] = frozenset()) -> dict[str, str]:
        """Which weight format (``kvledger.model.linear.FORMATS``) each matmul shape class of
        ``spec`` holds; ``q4_classes``: the classes the checkpoint stores as Q4;
        ``kquant_classes``: those it holds as a K-quant GGUF's blocks
        (:func:`kvledger.engine.tuning.probe.choose_formats`)."""
        if not self.device.probes:
            forced = probe.forced_formats()
            return {c: forced.get(c, self.device.choices["weight_format"]) for c in probe.CLASSES}
        return probe.choose_formats(spec, self.device, q4_classes, kquant_classes)

    def gemm_paths(self, spec: ModelSpec, formats: dict[str, str]
                   ) -> dict[str, tuple[int, str] | None]:
        """Class -> (rows, path): from how many rows its layers (in ``formats``) multiply on
        the weight dequantized per call (``kvledger.model.linear.GEMM_PATHS``); None: never
        (:func:`kvledger.engine.tuning.probe.choose_gemm`)."""
        if not self.device.probes:
            return dict.fromkeys(formats)
        return probe.choose_gemm(spec, self.device, formats)

    def fused_ops(self, spec: ModelSpec):
        """The device's fused element-wise ops within the probe's row limits
        (:func:`kvledger.engine.tuning.probe.fused_limits`)."""
        if not self.device.probes:
            return self.kernels.fused_ops()
        return self.kernels.fused_ops(probe.fused_limits(spec, self.device))
