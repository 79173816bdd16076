"""The CPU device: native kernels, their build, and the kernel probe."""
