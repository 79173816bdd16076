"""The device seam: the CPU device and its kernels have the protocols' shape, and without the
native library every kernel is absent and every op falls back to PyTorch."""

from __future__ import annotations

from kvledger.device import Device, Kernels
from kvledger.device.cpu import native, w8a8
from kvledger.device.cpu.device import CPU


def test_the_cpu_is_a_device_and_its_kernels_are_kernels():
    assert isinstance(CPU, Device)
    assert isinstance(CPU.kernels, Kernels)


def test_the_kernels_build_here():
    """g++ is part of this project's machines (the fallback is the next test)."""
    kernels = CPU.kernels
    assert kernels.library() is not None
    assert kernels.w8a8() is not None and kernels.kv_encoder() is not None
    assert kernels.fused_ops().name == "native"


def test_without_the_library_every_kernel_is_none_and_the_ops_are_pytorch(monkeypatch):
    monkeypatch.setenv("KVLEDGER_NATIVE", "0")
    native.library.cache_clear()
    w8a8.kernel.cache_clear()
    try:
        kernels = CPU.kernels
        assert kernels.library() is None
        assert "KVLEDGER_NATIVE=0" in kernels.why_unavailable()
        assert kernels.w8a8() is None and kernels.kv_encoder() is None
        assert kernels.fused_ops().name == "torch"
    finally:
        native.library.cache_clear()
        w8a8.kernel.cache_clear()
