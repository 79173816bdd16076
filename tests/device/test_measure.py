"""``measure`` returns a plausible local device (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import pytest


def test_measure_tiny():
    pytest.importorskip("torch")
    from kvledger.device.measure import measure

    dev = measure(buffer_mib=4, matmul_n=64, repeats=2)
    assert dev.name == "local"
    assert dev.memory_gib > 0 and dev.bandwidth_gbs > 0 and dev.tflops > 0
    assert dev.source.startswith("measured by kvledger probe")


def test_matmul_side_is_bounded_by_the_time_budget():
    """The default matmul side grows by doubling from 256 while the next size fits the budget:
    a zero budget keeps the smallest side, an unbounded one reaches the largest allowed."""
    torch = pytest.importorskip("torch")
    from kvledger.device.measure import _matmul_side

    assert _matmul_side(torch.float32, 2048, budget_s=0.0) == 256
    assert _matmul_side(torch.float32, 512, budget_s=float("inf")) == 512
