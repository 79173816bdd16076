"""The torch thread team shrinks while other processes take CPUs of this process's mask.

An OpenMP team splits each op's work evenly and waits for its slowest member at the end. When
another process runs on one of the team's CPUs, the member there gets a share of that CPU in
slices of milliseconds, and every op of a step waits for it: measured on a 2-core AMD EPYC with
one busy process pinned to a core (bundled model), batch-1 decode 10.7 -> 39.9 ms per token and
batch-8 272 -> 34 tok/s with 2 threads, 10.1 -> 10.4 ms with 1 thread. OpenMP's passive wait
policy lets the scheduler move the late member, but costs every uncontended step (10.7 -> 15.4
ms), so the team is sized instead.

Once per ``window_s`` the engine's thread asks :meth:`ThreadTeam.size`: from ``/proc/stat``
(proc(5): the CPU time of each CPU of the mask, idle and iowait excluded) less this process's
own CPU time, the CPUs other processes took over the window. The team is the mask's CPUs less
those others use more than ``tolerance`` of, rounded up per CPU (:func:`team_size`), at most
the usable count (``cpu_quota.py``), at least 1. A smaller team leaves the taken CPU to the
other process, so the figure keeps saying taken until it is given back.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger("kvledger.engine")

WINDOW_S = 1.0
"""Seconds of CPU accounting behind each decision."""
TOLERANCE = 0.25
"""CPUs' worth of other processes' time tolerated before a member is dropped."""
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (proc(5), /proc/stat)


def team_size(cpus: int, others: float, most: int, tolerance: float = TOLERANCE) -> int:
    """Threads for a team on ``cpus`` CPUs of which other processes used ``others`` CPUs'
    worth (CPU-seconds per second): one CPU less per started CPU above ``tolerance``, within
    1..``most``."""
    taken = max(0, math.ceil(others - tolerance))
    return max(1, min(most, cpus - taken))


def mask_busy_s(cpus: Iterable[int], stat: Path = Path("/proc/stat")) -> float:
    """CPU-seconds the ``cpus`` have been busy since boot (``/proc/stat``'s ``cpuN`` lines,
    in USER_HZ ticks).

    Raises:
        OSError: the file cannot be read. ValueError: a CPU's line is missing or malformed.
    """
    wanted = {f"cpu{c}" for c in cpus}
    ticks, seen = 0, set()
    for line in stat.read_text().splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            fields = [int(f) for f in rest.split()]
            ticks += sum(fields[i] for i in BUSY_FIELDS if i < len(fields))
            seen.add(name)
    if seen != wanted:
        raise ValueError(f"{stat} has no line for {', '.join(sorted(wanted - seen))}")
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadTeam:
    """Sizes the team from what other processes take of the mask's CPUs.

    Args:
        most: the usable CPUs (the team's size when nothing else runs).
        cpus: the CPU ids of the affinity mask.
        busy_s: CPU-seconds the mask's CPUs have been busy (default :func:`mask_busy_s`).
        own_s: this process's CPU-seconds (default ``time.process_time``).
        clock: seconds (default ``time.monotonic``).
    """

    def __init__(self, most: int, cpus: Iterable[int], busy_s: Callable[[], float] | None = None,
                 own_s: Callable[[], float] = time.process_time,
                 clock: Callable[[], float] = time.monotonic,
                 window_s: float = WINDOW_S) -> None:
        self.cpus = sorted(cpus)
        self.most, self.threads, self.window_s = most, most, window_s
        self._busy_s = busy_s or (lambda: mask_busy_s(self.cpus))
        self._own_s, self._clock = own_s, clock
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        return self._clock(), self._busy_s(), self._own_s()

    def size(self) -> int:
        """The team's size now: re-decided once ``window_s`` has passed since the last
        decision, else the last one (one clock read)."""
        now = self._clock()
        if now - self._last[0] < self.window_s:
            return self.threads
        sample = self._sample()
        wall, busy, own = (b - a for a, b in zip(self._last, sample))
        self._last = sample
        others = max(0.0, busy - own) / wall
        threads = team_size(len(self.cpus), others, self.most)
        log.debug("other processes used %.2f CPUs over %.2f s: %d threads", others, wall, threads)
        if threads != self.threads:
            log.info("torch threads %d -> %d: other processes used %.2f of this process's %d "
                     "CPUs over the last %.1f s", self.threads, threads, others, len(self.cpus),
                     wall)
            self.threads = threads
        return threads


def thread_team(most: int) -> ThreadTeam | None:
    """A team over this process's affinity mask, or None (logged) where ``/proc/stat`` cannot
    be read (not Linux) or there is one thread to begin with."""
    if most < 2:
        return None
    try:
        cpus = os.sched_getaffinity(0)
        return ThreadTeam(most, cpus)
    except (AttributeError, OSError, ValueError) as exc:
        log.info("torch threads stay at %d (the CPUs' use cannot be read: %s)", most, exc)
        return None
