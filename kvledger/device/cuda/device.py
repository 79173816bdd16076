"""The CUDA device (:class:`kvledger.device.Device`): one GPU, ``torch.cuda``'s current one,
computing through its Triton kernels (:data:`KERNELS`). Unavailable, so ``resolve("cuda")``
refuses it with a user error, where torch sees no CUDA GPU or triton is not installed.

Its host side has no thread team: the step hook does nothing and no pool is held per thread.
"""

from __future__ import annotations

import torch

from kvledger.device.cuda.kernels import CudaKernels


class NoStepHook:
    """The CUDA device's step hook: a GPU has no workers to adjust before a step."""

    def before_step(self) -> None:
        """Nothing."""


class CudaDevice:
    """The CUDA device's :class:`kvledger.device.Device`."""

    name = "cuda"

    def __init__(self) -> None:
        self.kernels = CudaKernels(self.compute_units)

    def unavailable(self) -> str:
        """Why this machine cannot run the device: no CUDA GPU seen by torch, or no triton."""
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "built for CUDA"
            return (f"torch {torch.__version__} ({build}) sees no CUDA GPU; use --device cpu, "
                    "or install a CUDA build of torch on a machine with an NVIDIA GPU")
        return self.kernels.why_unavailable()

    def identity(self) -> str:
        """The GPU's name, compute capability and memory, and the CUDA and triton versions."""
        import triton

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
