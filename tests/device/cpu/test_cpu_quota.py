"""The usable CPU count (kvledger.device.cpu.cpu_quota) against fake cgroup trees.

Each tree is laid out as the kernel presents it (Documentation/admin-guide/cgroup-v2.rst,
Documentation/scheduler/sched-bwc.rst, proc(5) for ``/proc/self/cgroup`` and
``/proc/self/mountinfo``); the expected counts are worked by hand from the files written.
"""

import logging
from pathlib import Path

import pytest

from kvledger.device.cpu.cpu_quota import choose_threads, cpu_budget

V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 " \
           "cgroup2 rw,nsdelegate"
V1_MOUNTS = ("31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
             "35 31 0:30 {root} /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:12 - cgroup "
             "cgroup rw,cpu,cpuacct\n"
             "36 31 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
             "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw")


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v2_tree(root: Path, cgroup: str, files: dict[str, str]) -> Path:
    _write(root, "proc/self/cgroup", f"0::{cgroup}\n")
    _write(root, "proc/self/mountinfo", V2_MOUNT + "\n")
    (root / "sys/fs/cgroup" / cgroup.strip("/")).mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        _write(root, f"sys/fs/cgroup/{rel}", text)
    return root


def _v1_tree(root: Path, cgroup: str, files: dict[str, str], mount_root: str = "/") -> Path:
    _write(root, "proc/self/cgroup",
           f"12:memory:{cgroup}\n4:cpu,cpuacct:{cgroup}\n0::/\n")
    _write(root, "proc/self/mountinfo", V1_MOUNTS.format(root=mount_root) + "\n")
    for rel, text in files.items():
        _write(root, f"sys/fs/cgroup/cpu,cpuacct/{rel}", text)
    return root


def test_v2_container_quota_is_rounded_down(tmp_path):
    # docker --cpus 1.5 in a cgroup namespace: the container's cgroup is the mount's root
    root = _v2_tree(tmp_path, "/", {"cpu.max": "150000 100000\n"})
    budget = cpu_budget(root, affinity=8)
    assert budget.cpus == 1
    assert "cpu.max 150000 100000" in budget.source and "affinity mask of 8" in budget.source


def test_v2_the_smallest_quota_over_the_ancestors_wins(tmp_path):
    # a Kubernetes pod limit of 3 CPUs above a container with no limit of its own ...
    root = _v2_tree(tmp_path / "a", "/kubepods/pod1/ctr",
                    {"kubepods/pod1/cpu.max": "300000 100000\n",
                     "kubepods/pod1/ctr/cpu.max": "max 100000\n"})
    assert cpu_budget(root, affinity=64).cpus == 3
    # ... and a container limit of 2.5 CPUs (period 50 ms) inside a pod limit of 4
    root = _v2_tree(tmp_path / "b", "/kubepods/pod1/ctr",
                    {"kubepods/pod1/cpu.max": "400000 100000\n",
                     "kubepods/pod1/ctr/cpu.max": "125000 50000\n"})
    assert cpu_budget(root, affinity=64).cpus == 2


def test_v2_without_a_limit_or_above_the_mask_keeps_the_mask(tmp_path):
    root = _v2_tree(tmp_path / "a", "/user.slice", {"user.slice/cpu.max": "max 100000\n"})
    assert cpu_budget(root, affinity=4).cpus == 4
    root = _v2_tree(tmp_path / "b", "/", {"cpu.max": "800000 100000\n"})
    budget = cpu_budget(root, affinity=2)
    assert budget.cpus == 2 and "under the cgroup CPU quota of 8 CPUs" in budget.source


def test_a_quota_under_one_cpu_still_gives_one_thread(tmp_path):
    root = _v2_tree(tmp_path, "/", {"cpu.max": "20000 100000\n"})
    assert cpu_budget(root, affinity=16).cpus == 1


def test_v1_quota_of_the_process_cgroup(tmp_path):
    root = _v1_tree(tmp_path, "/docker/abc",
                    {"docker/abc/cpu.cfs_quota_us": "300000\n",
                     "docker/abc/cpu.cfs_period_us": "100000\n",
                     "cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"})
    budget = cpu_budget(root, affinity=64)
    assert budget.cpus == 3 and "cpu.cfs_quota_us 300000 / period 100000" in budget.source


def test_v1_mount_rooted_at_the_container_cgroup(tmp_path):
    # no cgroup namespace: /proc/self/cgroup names the host path, the mount shows only its own
    root = _v1_tree(tmp_path, "/docker/abc",
                    {"cpu.cfs_quota_us": "200000\n", "cpu.cfs_period_us": "100000\n"},
                    mount_root="/docker/abc")
    assert cpu_budget(root, affinity=32).cpus == 2


def test_v1_without_a_quota_keeps_the_mask(tmp_path):
    root = _v1_tree(tmp_path, "/", {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n"})
    budget = cpu_budget(root, affinity=6)
    assert budget.cpus == 6 and "no cgroup CPU quota" in budget.source


def test_no_cgroups_at_all_keeps_the_mask(tmp_path):
    assert cpu_budget(tmp_path, affinity=3).cpus == 3  # no /proc/self/cgroup (not Linux)


@pytest.mark.parametrize("cpu_max", ["garbage\n", "150000\n", "-5 100000\n", "100000 0\n"])
def test_an_unparsable_file_falls_back_to_the_mask_with_a_warning(tmp_path, caplog, cpu_max):
    root = _v2_tree(tmp_path, "/", {"cpu.max": cpu_max})
    with caplog.at_level(logging.WARNING, logger="kvledger.engine"):
        assert cpu_budget(root, affinity=4).cpus == 4
    assert "cannot read the cgroup CPU quota" in caplog.text and "cpu.max" in caplog.text


def test_an_unreadable_file_falls_back_to_the_mask_with_a_warning(tmp_path, caplog):
    root = _v1_tree(tmp_path, "/", {"cpu.cfs_period_us": "100000\n"})
    (root / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us").mkdir()  # reading it fails (EISDIR)
    with caplog.at_level(logging.WARNING, logger="kvledger.engine"):
        assert cpu_budget(root, affinity=5).cpus == 5
    assert "cannot read the cgroup CPU quota" in caplog.text


def test_threads_requested_win_and_the_budget_splits_over_ranks(tmp_path):
    root = _v2_tree(tmp_path, "/", {"cpu.max": "400000 100000\n"})
    budget = cpu_budget(root, affinity=64)
    assert choose_threads(3, budget=budget) == (3, "--threads")
    threads, source = choose_threads(None, budget=budget)
    assert threads == 4 and "cpu.max" in source
    threads, source = choose_threads(None, ranks=3, budget=budget)
    assert threads == 1 and "split over 3 tensor-parallel ranks" in source
    assert choose_threads(None, ranks=8, budget=budget)[0] == 1
