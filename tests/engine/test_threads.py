"""The engine sets torch's thread count from ``--threads`` or the usable CPUs, and logs where
the count came from (kvledger.device.cpu.cpu_quota)."""

from __future__ import annotations

import logging

import pytest

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


class _Team:
    """A thread team whose size the test sets."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def size(self) -> int:
        return self.threads


def test_each_step_runs_the_teams_size_and_threads_fixes_it(tiny_engine_factory):
    import torch

    from kvledger.engine.sample.sampling_params import SamplingParams

    previous = torch.get_num_threads()
    try:
        assert tiny_engine_factory(num_threads=2)._step_hook._team is None  # a fixed team
        engine = tiny_engine_factory(num_threads=None)
        hook = engine._step_hook  # the device's (kvledger.device.cpu.device.CpuThreads)
        if hook._team is None:
            pytest.skip("no thread team here: one usable CPU, or /proc/stat unreadable")
        hook._team = _Team(1)
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
        engine.step()
        assert torch.get_num_threads() == 1
        hook._team.threads = hook._team.size() + 1
        engine.step()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
