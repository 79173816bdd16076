"""The device seam: a device is resolved by name (an unknown one is a user error naming it), the
CPU device, its kernels and its step hook have the protocols' shape, and without the native
library every kernel is absent and every op falls back to PyTorch."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from kvledger.device import DEVICES, Device, Kernels, StepHook, resolve
from kvledger.device.cpu import native, w8a8
from kvledger.errors import InvalidParameterError

CPU = resolve("cpu")


def test_the_cpu_is_a_device_and_its_kernels_are_kernels():
    assert isinstance(CPU, Device)
    assert isinstance(CPU.kernels, Kernels)
    assert resolve("cpu") is CPU and CPU.name == "cpu" and "cpu" in DEVICES
    assert CPU.identity() and CPU.compute_units() >= 1


def test_an_unknown_device_is_a_user_error_that_names_it():
    with pytest.raises(InvalidParameterError, match="device must be one of cpu, cuda, got 'tpu'"):
        resolve("tpu")


def test_the_engine_option_refuses_an_unknown_device_with_exit_2():
    from kvledger.cli import app

    r = CliRunner().invoke(app, ["generate", "--device", "tpu", "hello"])
    assert r.exit_code == 2, r.output
    assert "'tpu'" in r.output and "Traceback" not in r.output


def test_the_step_hook_sets_the_threads_asked_for():
    before = torch.get_num_threads()
    try:
        hook = CPU.threads(1)
        assert isinstance(hook, StepHook)
        assert torch.get_num_threads() == 1
        hook.before_step()  # a fixed count: no team to follow
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


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
