"""The torch thread team's size from other processes' use of the mask's CPUs
(kvledger.device.cpu.thread_team): the rule worked by hand, /proc/stat as proc(5) lays it out,
and the decisions over fake clocks and counters."""

from __future__ import annotations

import os

import pytest

from kvledger.device.cpu.thread_team import ThreadTeam, mask_busy_s, team_size

# proc(5): cpuN user nice system idle iowait irq softirq steal guest guest_nice (USER_HZ ticks)
STAT = """cpu  900 10 300 5000 40 0 5 0 0 0
cpu0 400 5 100 2500 20 0 2 0 0 0
cpu1 500 5 200 2500 20 0 3 7 0 0
intr 12345 0 0
"""


@pytest.mark.parametrize("cpus,others,most,expected", [
    (2, 0.0, 2, 2),    # nothing else runs
    (2, 0.2, 2, 2),    # under the tolerance (a light client, a log shipper)
    (2, 0.5, 2, 1),    # a busy process sharing one core with a member
    (2, 1.0, 2, 1),    # ... and the core it keeps once the team has left it
    (2, 2.0, 2, 1),    # never below 1
    (8, 1.3, 8, 6),    # two started CPUs over the tolerance
    (64, 10.0, 2, 2),  # a quota of 2 on a large host with room left
])
def test_team_size(cpus, others, most, expected):
    assert team_size(cpus, others, most) == expected


def test_mask_busy_s_counts_busy_fields_of_the_masks_cpus(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    hz = os.sysconf("SC_CLK_TCK")
    assert mask_busy_s([1], stat) == (500 + 5 + 200 + 0 + 3 + 7) / hz  # idle, iowait left out
    assert mask_busy_s([0, 1], stat) == (507 + 715) / hz
    with pytest.raises(ValueError, match="cpu2"):
        mask_busy_s([1, 2], stat)


class _Counters:
    """A fake clock with the mask's busy seconds and this process's CPU seconds."""

    def __init__(self):
        self.now = self.busy = self.own = 0.0

    def advance(self, seconds: float, ours: float, others: float) -> None:
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds


def _team(counters: _Counters) -> ThreadTeam:
    return ThreadTeam(2, [0, 1], busy_s=lambda: counters.busy, own_s=lambda: counters.own,
                      clock=lambda: counters.now, window_s=1.0)


def test_team_shrinks_while_a_process_takes_a_cpu_and_grows_back():
    c = _Counters()
    team = _team(c)
    c.advance(1.0, ours=2.0, others=0.05)
    assert team.size() == 2
    c.advance(0.5, ours=1.5, others=0.5)
    assert team.size() == 2  # inside the window: no new decision
    c.advance(0.5, ours=1.5, others=0.5)
    assert team.size() == 1
    c.advance(1.0, ours=1.0, others=1.0)  # the other process keeps its CPU
    assert team.size() == 1
    c.advance(1.0, ours=1.0, others=0.0)  # ... and leaves
    assert team.size() == 2


def test_an_idle_engine_decides_over_the_whole_gap():
    c = _Counters()
    team = _team(c)
    c.advance(30.0, ours=0.0, others=0.1)  # idle server, a light neighbour
    assert team.size() == 2
