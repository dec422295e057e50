"""The adaptive thread policy (engine/threads.py) on synthetic step sequences: no torch, no sockets, no clock.

A step is (wall seconds, run-queue delay seconds, throttled seconds). `Machine` plays the CPU: with a busy
neighbour on a 2-core machine, 2 threads wait a third of the time (three runnable threads share two cores)
and 1 thread does not wait; a 1-CPU quota throttles 2 threads half the time.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from steadyserve.engine.threads import (REASON_PROBE, REASON_RUN_DELAY, REASON_THROTTLED, CpuSignals, ThreadChange,
                                        ThreadPolicy, _throttled_seconds)

STEP = 0.01  # seconds per decode step


@dataclass
class Machine:
    cores: int = 2
    neighbours: int = 0  # busy threads beside the server
    quota: float = 0.0  # CPUs of a CFS quota; 0 = none

    def step(self, threads: int) -> tuple[float, float, float]:
        runnable = threads + self.neighbours
        delay = STEP * max(0.0, 1 - self.cores / runnable) if runnable > self.cores else 0.0
        throttled = STEP * max(0.0, 1 - self.quota / threads) if self.quota and threads > self.quota else 0.0
        return STEP, delay + throttled, throttled


def run(policy: ThreadPolicy, machine: Machine, seconds: float) -> list[tuple[int, ThreadChange | None]]:
    """Steps for `seconds` of step time: (threads the step ran with, the change it caused)."""
    out = []
    for _ in range(round(seconds / STEP)):
        ran = policy.threads
        change = policy.observe(*machine.step(ran))
        assert 1 <= policy.threads <= policy.budget
        out.append((ran, change))
    return out


def changes(trace: list[tuple[int, ThreadChange | None]]) -> list[ThreadChange]:
    return [c for _, c in trace if c is not None]


def share_at(trace: list[tuple[int, ThreadChange | None]], threads: int) -> float:
    return sum(1 for ran, _ in trace if ran == threads) / len(trace)


def test_a_quiet_machine_never_changes_the_count():
    p = ThreadPolicy(2)
    assert changes(run(p, Machine(), 60)) == [] and p.threads == 2


def test_quiet_then_a_neighbour_then_quiet_drops_to_one_and_comes_back():
    p, m = ThreadPolicy(2), Machine()
    assert changes(run(p, m, 5)) == []
    m.neighbours = 1
    starved = run(p, m, 30)
    first = changes(starved)[0]
    assert (first.threads, first.previous, first.reason) == (1, 2, REASON_RUN_DELAY)
    assert abs(first.fraction - 1 / 3) < 1e-9
    # Dropped within the first confirm windows (2 x 0.2 s = 40 steps), not after.
    assert starved.index((2, first)) < 2 * p.window_steps + 2 * round(p.window_s / STEP)
    # Probes come back, each one fails, the hold doubles: bounded flapping, most of the time at 1 thread.
    ups = [c for c in changes(starved) if c.reason == REASON_PROBE]
    downs = [c for c in changes(starved) if c.reason != REASON_PROBE]
    assert 2 <= len(ups) <= 5 and len(downs) - len(ups) in (0, 1), changes(starved)
    assert share_at(starved, 1) > 0.9
    assert p.hold > p.hold_s  # failed probes lengthened the hold
    m.neighbours = 0
    quiet = run(p, m, 60)
    assert p.threads == 2 and changes(quiet)[-1].reason == REASON_PROBE
    assert p.hold == p.hold_s  # the probe held: back to the short hold
    assert share_at(quiet[-round(20 / STEP):], 2) == 1.0  # and stays up


def test_a_persistent_neighbour_costs_at_most_one_probe_per_max_hold():
    p, m = ThreadPolicy(2), Machine(neighbours=1)
    trace = run(p, m, 600)
    # Holds 2, 4, 8, 16, 32, then 60 s: ~16 probes in 10 minutes at most, each ~0.4 s at 2 threads.
    ups = [c for c in changes(trace) if c.reason == REASON_PROBE]
    assert len(ups) <= 600 / p.max_hold_s + 6, len(ups)
    assert share_at(trace, 2) < 0.03
    assert p.hold == p.max_hold_s


def test_a_cfs_quota_throttles_and_the_reason_says_so():
    p, m = ThreadPolicy(2), Machine(cores=4, quota=1.0)
    trace = run(p, m, 10)
    first = changes(trace)[0]
    assert (first.threads, first.reason) == (1, REASON_THROTTLED)
    assert share_at(trace, 1) > 0.7


def test_a_single_spike_never_drops():
    p = ThreadPolicy(2)
    for i in range(3000):
        delay = 0.5 if i in (500, 1500, 2500) else 0.0  # one step waiting 0.5 s (a page-fault storm, a cron job)
        assert p.observe(0.51 if delay else STEP, delay) is None
    assert p.threads == 2


def test_waits_hovering_around_the_threshold_never_drop():
    p = ThreadPolicy(2)
    window = round(p.window_s / STEP)
    for w in range(400):  # starved and quiet windows alternate: never `confirm` starved ones in a row
        f = 0.3 if w % 2 else 0.01
        for _ in range(window):
            assert p.observe(STEP, STEP * f) is None
    assert p.threads == 2


def test_between_the_thresholds_nothing_changes_either_way():
    p = ThreadPolicy(2)
    run(p, Machine(neighbours=1), 1)
    assert p.threads == 1
    for _ in range(round(30 / STEP)):  # 7% waiting: not starved, not quiet: no probe however long
        assert p.observe(STEP, STEP * 0.07) is None
    assert p.threads == 1


def test_never_above_the_budget_and_drops_in_proportion():
    p, m = ThreadPolicy(8), Machine(cores=8, neighbours=4)  # 12 runnable on 8 cores: a third waiting
    trace = run(p, m, 2)
    first = changes(trace)[0]
    assert (first.previous, first.threads) == (8, 5)  # 8 - round(8/3)
    assert p.threads == 4  # 9 runnable at 5 threads: still starved, one more step down, then quiet
    m.neighbours = 0
    trace = run(p, m, 30)
    assert [c.threads for c in changes(trace)] == [8]  # doubles, capped at the budget
    assert max(ran for ran, _ in trace) == 8


def test_budget_one_never_changes():
    p = ThreadPolicy(1)
    assert changes(run(p, Machine(cores=1, neighbours=3), 30)) == [] and p.threads == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        ThreadPolicy(0)
    with pytest.raises(ValueError):
        ThreadPolicy(2, quiet_fraction=0.2, starved_fraction=0.1)


# ---- the signals ------------------------------------------------------------------------------------------

def test_throttled_time_of_cgroup_v1_and_v2():
    assert _throttled_seconds("nr_periods 31\nnr_throttled 31\nthrottled_time 1172134547\n") == 1.172134547
    assert _throttled_seconds("usage_usec 5\nnr_throttled 3\nthrottled_usec 2500000\n") == 2.5
    assert _throttled_seconds("usage_usec 5\n") == 0.0


def test_signals_read_the_calling_threads_schedstat_and_the_cgroup_file(tmp_path: Path):
    stat = tmp_path / "cpu.stat"
    stat.write_text("nr_periods 1\nnr_throttled 1\nthrottled_usec 1500000\n")
    sig = CpuSignals(stat)
    try:
        delay0, throttled = sig.read()
        assert throttled == 1.5
        own = int(Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()[1]) / 1e9
        assert 0 <= delay0 <= own
        stat.write_text("nr_periods 2\nnr_throttled 2\nthrottled_usec 2000000\n")  # the same inode, read again
        delay1, throttled = sig.read()
        assert throttled == 2.0 and delay1 >= delay0
        got: list[tuple[float, float]] = []
        t = threading.Thread(target=lambda: got.append(sig.read()))  # another thread: its own file
        t.start()
        t.join()
        assert got and got[0][1] == 2.0
    finally:
        sig.close()
    none = CpuSignals(tmp_path / "absent" / "cpu.stat")
    assert none.read()[1] == 0.0
    none.close()
    assert os.path.exists("/proc/thread-self/schedstat")
