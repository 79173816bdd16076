"""The CPUs this process may really use: its affinity mask and its cgroup's CPU quota.

A container's CPU limit (``docker --cpus 2``, a Kubernetes CPU limit) is a CFS bandwidth quota,
not an affinity mask: the process sees every core but runs at most ``quota / period`` CPUs'
worth of time per period, so a team of more threads than that waits on throttled members.
The quota is read in the process's own cgroup (``/proc/self/cgroup``) and in each of its
ancestors (the smallest wins): cgroup v2 ``cpu.max`` (``max`` or ``QUOTA PERIOD``), v1
``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``; where each hierarchy is mounted
comes from ``/proc/self/mountinfo``. Sources: the Linux kernel's
Documentation/admin-guide/cgroup-v2.rst (``cpu.max``) and Documentation/scheduler/sched-bwc.rst.

The usable count is ``min(affinity, floor(quota))``, at least 1. A cgroup file that exists but
cannot be read or parsed is logged as a warning and the affinity mask is used.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("kvledger.engine")


@dataclass(frozen=True)
class CpuBudget:
    """CPUs this process may use (>= 1) and where that count came from (a phrase for logs)."""

    cpus: int
    source: str


@dataclass(frozen=True)
class _Mount:
    root: str  # the cgroup path mounted there
    point: Path  # where, under the injected root


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@functools.cache
def cpu_budget(root: Path = Path("/"), affinity: int | None = None) -> CpuBudget:
    """The usable CPUs: the affinity mask (``affinity``, default ``os.sched_getaffinity``)
    capped by the cgroup quota found under ``root`` (``/``; a fake tree in tests). Cached per
    argument: one reading, one warning per process."""
    affinity = _affinity() if affinity is None else affinity
    mask = f"affinity mask of {affinity} CPU{'s' * (affinity != 1)}"
    try:
        quota = cgroup_quota(root)
    except (OSError, ValueError) as exc:
        log.warning("cannot read the cgroup CPU quota (%s); using the %s", exc, mask)
        return CpuBudget(affinity, mask)
    if quota is None:
        return CpuBudget(affinity, f"{mask}, no cgroup CPU quota")
    cpus, where = quota
    quota_text = f"cgroup CPU quota of {cpus:g} CPUs ({where})"
    if int(cpus) >= affinity:
        return CpuBudget(affinity, f"{mask}, under the {quota_text}")
    return CpuBudget(max(1, int(cpus)), f"{quota_text}, rounded down; {mask}")


def cgroup_quota(root: Path) -> tuple[float, str] | None:
    """The smallest CPU quota over the process's cgroups and their ancestors, as CPUs, with
    the file it came from; None when no quota is set (or the system has no cgroups).

    Raises:
        OSError: a cgroup file exists but cannot be read.
        ValueError: a cgroup file does not hold what the kernel writes there.
    """
    membership = root / "proc/self/cgroup"
    if not membership.exists():
        return None
    mounts = _mounts(root)
    found = []
    for line in membership.read_text().splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            raise ValueError(f"{membership}: unexpected line {line!r}")
        _, controllers, path = parts
        if controllers == "" and "cgroup2" in mounts:
            found += _walk(mounts["cgroup2"], path, _v2_quota)
        elif "cpu" in controllers.split(",") and "cpu" in mounts:
            found += _walk(mounts["cpu"], path, _v1_quota)
    return min(found, default=None)


def _mounts(root: Path) -> dict[str, _Mount]:
    """The cgroup2 mount and the v1 mount holding the ``cpu`` controller, by kind."""
    mountinfo = root / "proc/self/mountinfo"
    mounts: dict[str, _Mount] = {}
    if not mountinfo.exists():
        return mounts
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        if "-" not in fields or len(fields) < 5:
            raise ValueError(f"{mountinfo}: unexpected line {line!r}")
        tail = fields[fields.index("-") + 1:]  # filesystem type, source, super options
        mount = _Mount(fields[3], root / fields[4].lstrip("/"))
        if tail[:1] == ["cgroup2"]:
            mounts.setdefault("cgroup2", mount)
        elif tail[:1] == ["cgroup"] and len(tail) >= 3 and "cpu" in tail[2].split(","):
            mounts.setdefault("cpu", mount)
    return mounts


def _walk(mount: _Mount, path: str, read) -> list[tuple[float, str]]:
    """``read(folder)`` for the cgroup ``path`` and each ancestor inside ``mount``."""
    relative = path
    if mount.root != "/" and (path == mount.root or path.startswith(mount.root + "/")):
        relative = path[len(mount.root):]
    folder = mount.point / relative.strip("/")
    if not folder.is_dir():  # a path outside this mount's view (a container's)
        folder = mount.point
    quotas = []
    while True:
        quota = read(folder)
        if quota is not None:
            quotas.append(quota)
        if folder == mount.point:
            return quotas
        folder = folder.parent


def _v2_quota(folder: Path) -> tuple[float, str] | None:
    path = folder / "cpu.max"
    if not path.exists():
        return None
    text = path.read_text().split()
    if not (len(text) == 2 and text[1].isdigit() and (text[0] == "max" or text[0].isdigit())):
        raise ValueError(f"{path}: expected 'max PERIOD' or 'QUOTA PERIOD', got "
                         f"{' '.join(text)!r}")
    if text[0] == "max":
        return None
    return _ratio(int(text[0]), int(text[1]), path, f"cpu.max {text[0]} {text[1]}")


def _v1_quota(folder: Path) -> tuple[float, str] | None:
    quota_path, period_path = folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us"
    if not quota_path.exists():
        return None
    quota = int(quota_path.read_text())  # ValueError when not an integer
    if quota < 0:  # -1: no limit
        return None
    period = int(period_path.read_text())
    return _ratio(quota, period, quota_path, f"cpu.cfs_quota_us {quota} / period {period}")


def _ratio(quota: int, period: int, path: Path, said: str) -> tuple[float, str]:
    if period <= 0:
        raise ValueError(f"{path}: a period of {period} us")
    return quota / period, f"{said} in {path.parent}"


def choose_threads(requested: int | None, ranks: int = 1,
                   budget: CpuBudget | None = None) -> tuple[int, str]:
    """Threads per rank: ``requested`` (``--threads``), else the usable CPUs split over
    ``ranks`` (at least 1); with the phrase saying where the count came from."""
    if requested:
        return requested, "--threads"
    budget = budget or cpu_budget()
    threads = max(1, budget.cpus // ranks)
    split = f", split over {ranks} tensor-parallel ranks" if ranks > 1 else ""
    return threads, budget.source + split
