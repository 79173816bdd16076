"""``measure`` returns a plausible local device (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import pytest


def test_measure_tiny():
    pytest.importorskip("torch")
    from kvledger.ledger.probe import measure

    dev = measure(buffer_mib=4, matmul_n=64, repeats=2)
    assert dev.name == "local"
    assert dev.memory_gib > 0 and dev.bandwidth_gbs > 0 and dev.tflops > 0
    assert dev.source.startswith("measured by kvledger probe")
