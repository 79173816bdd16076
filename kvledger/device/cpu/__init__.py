"""The CPU device: the C++ kernels (``csrc/``), their build (:mod:`.native`), their ctypes
wrappers (:mod:`.w8a8`, :mod:`.kquant`, :mod:`.fused`, :mod:`.kv_encode`, the paged-attention
kernel in :mod:`.native`), the OpenMP thread pool (:mod:`.omp`), the usable cores
(:mod:`.cpu_quota`) and the thread team (:mod:`.thread_team`). Outside ``kvledger/device/``
code reaches them through ``kvledger.device.resolve("cpu")``: :data:`.device.DEVICE` and its
:data:`.kernels.KERNELS`."""
