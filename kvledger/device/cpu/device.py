"""The CPU device (:class:`kvledger.device.Device`): its kernels (:data:`.kernels.KERNELS`),
its identity (model name and flags, :func:`.native.cpu_identity`), its usable cores
(:mod:`.cpu_quota`), the torch thread team that shrinks while other processes take its CPUs
(:mod:`.thread_team`, adjusted before each step in the thread that steps), the caps on
oneDNN's per-shape caches (:mod:`.onednn_cache`, set with the threads, before the first
product) and the release of a thread's OpenMP pool (:mod:`.omp`)."""

from __future__ import annotations

import logging
from typing import ClassVar

import torch

from kvledger.device.cpu import native, omp
from kvledger.device.cpu.cpu_quota import choose_threads, cpu_budget
from kvledger.device.cpu.kernels import KERNELS
from kvledger.device.cpu.onednn_cache import cap_caches
from kvledger.device.cpu.thread_team import ThreadTeam, thread_team

log = logging.getLogger("kvledger.engine")


class CpuThreads:
    """The CPU's step hook (:class:`kvledger.device.StepHook`): torch's thread count follows
    the team's size (None: a fixed count)."""

    def __init__(self, threads: int, team: ThreadTeam | None) -> None:
        self.threads, self._team = threads, team

    def before_step(self) -> None:
        """Set torch's thread count to the team's size when it changed (in the thread that
        steps: the count is OpenMP's per-thread setting)."""
        if self._team is not None and self._team.size() != self.threads:
            self.threads = self._team.size()
            torch.set_num_threads(self.threads)


class CpuDevice:
    """The CPU's :class:`kvledger.device.Device`."""

    name = "cpu"
    kernels = KERNELS
    torch_device = torch.device("cpu")
    probes = True
    """Choices are measured (``kvledger.engine.tuning.probe``)."""
    choices: ClassVar[dict[str, str]] = {}

    def unavailable(self) -> str:
        """'': every machine has a CPU."""
        return ""

    def identity(self) -> str:
        """:func:`kvledger.device.cpu.native.cpu_identity`."""
        return native.cpu_identity()

    def compute_units(self) -> int:
        """The usable CPUs (:func:`kvledger.device.cpu.cpu_quota.cpu_budget`)."""
        return cpu_budget().cpus

    def threads(self, requested: int | None, ranks: int = 1) -> CpuThreads:
        """Set torch's thread count (:func:`kvledger.device.cpu.cpu_quota.choose_threads`);
        a count the user did not fix, in one process, follows the thread team. Caps oneDNN's
        caches first (:func:`kvledger.device.cpu.onednn_cache.cap_caches`)."""
        cap_caches()
        threads, source = choose_threads(requested, ranks)
        torch.set_num_threads(threads)
        log.info("torch threads: %d (%s)", threads, source)
        team = thread_team(threads) if requested is None and ranks == 1 else None
        return CpuThreads(threads, team)

    def release_thread_pool(self) -> bool:
        """:func:`kvledger.device.cpu.omp.release_thread_pool` (libgomp's pool)."""
        return omp.release_thread_pool()


DEVICE = CpuDevice()
