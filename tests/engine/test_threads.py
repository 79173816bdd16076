"""The engine sets torch's thread count from ``--threads`` or the usable CPUs, and logs where
the count came from (kvledger.device.cpu.cpu_quota)."""

from __future__ import annotations

import logging

from kvledger.device.cpu.cpu_quota import cpu_budget


def test_the_engine_sets_and_logs_its_threads(tiny_engine_factory, caplog):
    import torch

    previous = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="kvledger.engine"):
            tiny_engine_factory(num_threads=1)
        assert torch.get_num_threads() == 1
        assert "torch threads: 1 (--threads)" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kvledger.engine"):
            tiny_engine_factory()
        assert f"torch threads: {cpu_budget().cpus} ({cpu_budget().source})" in caplog.text
        assert torch.get_num_threads() == cpu_budget().cpus
    finally:
        torch.set_num_threads(previous)
