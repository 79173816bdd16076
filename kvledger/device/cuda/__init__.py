"""The CUDA device: our own Triton kernels (:mod:`.triton_kernels`, one module per job), their
handles behind the ``Kernels`` protocol (:mod:`.kernels`), and the object ``resolve("cuda")``
hands out (:data:`.device.DEVICE`), refused with a user error on a machine without a CUDA GPU
or without triton. Nothing outside ``kvledger/device/`` imports this folder.

Verified so far under Triton's interpreter on CPU tensors only (``docs/gpu.md``)."""
