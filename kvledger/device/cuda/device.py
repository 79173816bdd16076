"""The CUDA device (:class:`kvledger.device.Device`): one GPU, ``torch.cuda``'s current one,
computing through its Triton kernels (:class:`.kernels.CudaKernels`); the engine puts the
weights, the KV pool, each step's metadata and the logits on :attr:`CudaDevice.torch_device`.
Unavailable, so ``resolve("cuda")`` refuses it with a user error, where torch sees no CUDA GPU
or triton is not installed.

Test mode (:func:`on_cpu`): with ``TRITON_INTERPRET=1`` and ``KVLEDGER_CUDA_ON_CPU=1`` both
set, the device is available on a machine without a GPU and its torch device is the CPU: the
engine runs the whole CUDA path (fixed choices instead of the CPU's probe, the Triton kernels
under Triton's interpreter, the placement calls) on CPU tensors. Either variable alone changes
nothing: ``--device cuda`` is refused as before.

Its host side has no thread team: the step hook does nothing and no pool is held per thread.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from kvledger.device.cuda.kernels import CudaKernels, interpreting

ON_CPU_ENV = "KVLEDGER_CUDA_ON_CPU"


def on_cpu() -> bool:
    """Whether the device runs in its test mode: CPU tensors under Triton's interpreter
    (``TRITON_INTERPRET=1`` and ``KVLEDGER_CUDA_ON_CPU=1``; never with a GPU seen)."""
    return (os.environ.get(ON_CPU_ENV) == "1" and interpreting()
            and not torch.cuda.is_available())


class NoStepHook:
    """The CUDA device's step hook: a GPU has no workers to adjust before a step."""

    def before_step(self) -> None:
        """Nothing."""


class CudaDevice:
    """The CUDA device's :class:`kvledger.device.Device`."""

    name = "cuda"
    probes = False
    """No measured choices (the CPU's probe times CPU paths): the engine takes
    :attr:`choices`, or what ``KVLEDGER_ATTENTION`` / ``KVLEDGER_WEIGHT_FORMAT`` force."""
    choices: ClassVar[dict[str, str]] = {"attention": "paged-native", "weight_format": "dense"}

    def __init__(self) -> None:
        self.kernels = CudaKernels(self.compute_units)

    @property
    def torch_device(self) -> torch.device:
        """Where the engine's tensors live: the current GPU (the CPU in the test mode)."""
        return torch.device("cpu" if on_cpu() else "cuda")

    def unavailable(self) -> str:
        """Why this machine cannot run the device: no CUDA GPU seen by torch (outside the
        test mode, :func:`on_cpu`), or no triton."""
        if on_cpu():
            return self.kernels.why_unavailable()
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "built for CUDA"
            return (f"torch {torch.__version__} ({build}) sees no CUDA GPU; use --device cpu, "
                    "or install a CUDA build of torch on a machine with an NVIDIA GPU")
        return self.kernels.why_unavailable()

    def identity(self) -> str:
        """The GPU's name, compute capability and memory, and the CUDA and triton versions."""
        import triton

        if on_cpu():
            return f"triton {triton.__version__} interpreter on the CPU (test mode)"
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        return (f"{p.name} sm_{p.major}{p.minor} {p.total_memory >> 30} GiB "
                f"cuda {torch.version.cuda} triton {triton.__version__}")

    def compute_units(self) -> int:
        """The GPU's streaming multiprocessors (1 where no GPU is seen)."""
        if not torch.cuda.is_available():
            return 1
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def threads(self, requested: int | None, ranks: int = 1) -> NoStepHook:
        """The GPU computes with its own units: nothing to start on the host."""
        return NoStepHook()

    def release_thread_pool(self) -> bool:
        """False: no pool is held per thread."""
        return False


DEVICE = CudaDevice()
