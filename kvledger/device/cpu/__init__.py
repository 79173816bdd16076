"""The CPU device: the C++ kernels (``csrc/``), their build (:mod:`.native`), their ctypes
wrappers (:mod:`.w8a8`, :mod:`.fused`, :mod:`.kv_encode`, the paged-attention kernel in
:mod:`.native`), the OpenMP thread pool (:mod:`.omp`), and the kernel probe that chooses among
them by measuring (:mod:`.kernel_probe`, :mod:`.probe_timing`). The engine and the model ask
:data:`kvledger.device.cpu.device.CPU`; the code that calls a kernel asks
:data:`kvledger.device.cpu.kernels.KERNELS`."""
