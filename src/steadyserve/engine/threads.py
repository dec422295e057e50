"""Adaptive intra-op threads: fewer while the process is starved of CPU, back up to the budget when it is not.

Why: every decode step opens ~200 parallel regions (at::parallel_for in the native kernels: one per matmul,
norm and attention call, per layer), and each region ends when its slowest thread does. When a neighbour
takes a core, or a CFS quota throttles the cgroup, one of our threads sits on a run queue in nearly every
region and the whole step waits for it: throughput collapses 7x-30x instead of in proportion to the CPU taken
(issue 40). Fewer threads than runnable cores never wait that way. The kernels are bitwise independent of the
thread count, so the engine may change it at any step without changing a bit or the fingerprint.

The signal (`CpuSignals`, read by the engine around each step):

* run-queue delay of the engine thread: field 2 of /proc/thread-self/schedstat (the `/proc/self/task/TID`
  file of the thread that steps), nanoseconds it was runnable but not running. The engine thread is the
  OpenMP master and takes part in every parallel region, so its wait is the step's. It includes CFS
  throttling (a throttled task stays runnable; measured: 2 threads under a 0.5-CPU quota wait 75% of the
  wall time). /proc/self/schedstat is the main thread's only (the event loop's, not the engine's), and
  summing /proc/self/task/*/schedstat would read dozens of files per step; one pread of one file costs
  ~1.3 us. Workers' waits are not counted, but under fair sharing the master waits as often as they do.
* cgroup CPU throttling: `throttled_usec` (v2) or `throttled_time` (v1, ns) of cpu.stat in the cgroup
  whose quota binds (cpu_budget.read_cpu_quota finds it). It is summed over CPUs, so its fraction of wall
  time may exceed 1; the policy clips it. Absent (0) when there is no quota.

The policy (`ThreadPolicy`), pure Python and clock-free (time is the steps' own wall time), so tests drive
it with synthetic sequences:

* Steps are pooled into windows of at least `window_s` seconds and `window_steps` steps (a CFS period is
  100 ms: a window sees two). A window's fraction is max(run delay, throttled time) / wall time.
* A window is starved at `starved_fraction` or more, quiet below `quiet_fraction`; in between it changes
  nothing (hysteresis).
* `confirm` consecutive starved windows drop the count by max(1, round(threads * fraction)), never below 1
  (with 2 threads and one busy neighbour: 1/3 of the time waiting, to 1 thread). One spike fills one
  window at most, so it never drops. A quiet window ends the streak.
* Below the budget, `hold_s` seconds of quiet windows probe up: the count doubles, never above `budget`.
  A drop within `probation_s` of a probe is a failed probe and doubles the hold (up to `max_hold_s`), so a
  neighbour that stays costs one short probe per `max_hold_s` at most; a probe that survives probation
  resets the hold to `hold_s`.
* Every change starts a fresh window: a count is judged only on steps run with it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

# Reasons of a change, the label of steadyserve_thread_changes_total.
REASON_RUN_DELAY = "run_queue_delay"  # down: the engine thread waited on a run queue (a busy neighbour, or throttling)
REASON_THROTTLED = "cgroup_throttled"  # down: the cgroup's CPU quota throttled it (cpu.stat)
REASON_PROBE = "probe"  # up: quiet for the hold period
CHANGE_REASONS = (REASON_RUN_DELAY, REASON_THROTTLED, REASON_PROBE)


@dataclass(frozen=True)
class ThreadChange:
    threads: int  # the count to run the next step with
    previous: int  # the count the window ran with
    reason: str  # one of CHANGE_REASONS
    fraction: float  # the deciding window's max(run delay, throttled) / wall time (clipped to 1)


@dataclass
class ThreadPolicy:
    """Decides the intra-op thread count of the next step from the wall time and CPU wait of past steps.

    Contract: `observe` once per step that ran the model, with that step's wall time, the engine thread's
    run-queue delay and the cgroup's throttled time over it (seconds, >= 0). It returns a ThreadChange when
    the next step should run with another count (the caller then sets it, e.g. torch.set_num_threads), else
    None. The count stays within 1..budget, starts at the budget, never rises above it, and only changes at
    window boundaries. With budget 1 it never changes.
    """

    budget: int  # the most threads: the CPU budget the server started with (cpu_budget.py, or --threads)
    starved_fraction: float = 0.10  # a window at this fraction of waiting (run delay or throttled) or more is starved
    quiet_fraction: float = 0.05  # one below it is quiet; in between, a window neither drops nor counts as quiet
    window_s: float = 0.2  # a window closes once its steps' wall time reaches this (two 100 ms CFS periods) ...
    window_steps: int = 4  # ... and it holds at least this many steps
    confirm: int = 2  # consecutive starved windows before a drop: a single spike fills one window at most
    hold_s: float = 2.0  # seconds of quiet windows below the budget before probing up
    max_hold_s: float = 60.0  # the hold doubles after each failed probe, up to this
    probation_s: float = 1.0  # a drop within this much step time after a probe fails it
    threads: int = field(init=False)  # the current count
    hold: float = field(init=False)  # the current hold, hold_s .. max_hold_s
    _wall: float = field(init=False, default=0.0)  # the open window: wall time,
    _delay: float = field(init=False, default=0.0)  # run-queue delay,
    _throttled: float = field(init=False, default=0.0)  # throttled time,
    _steps: int = field(init=False, default=0)  # and steps
    _starved: int = field(init=False, default=0)  # consecutive starved windows
    _quiet: float = field(init=False, default=0.0)  # quiet window time since the last starved window or change
    _since_probe: float | None = field(init=False, default=None)  # step time since a probe on probation; None = none

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError("ThreadPolicy: budget must be at least 1")
        if not 0 < self.quiet_fraction <= self.starved_fraction:
            raise ValueError("ThreadPolicy: need 0 < quiet_fraction <= starved_fraction")
        self.threads = self.budget
        self.hold = self.hold_s

    def observe(self, wall_s: float, run_delay_s: float, throttled_s: float = 0.0) -> ThreadChange | None:
        """One step's wall time and its waits; a ThreadChange when the next step should use another count."""
        if self.budget == 1:
            return None
        self._wall += max(wall_s, 0.0)
        self._delay += max(run_delay_s, 0.0)
        self._throttled += max(throttled_s, 0.0)
        self._steps += 1
        if self._wall < self.window_s or self._steps < self.window_steps:
            return None
        wall, delay, throttled = self._wall, self._delay, self._throttled
        self._new_window()
        delay_f = min(1.0, delay / wall) if wall > 0 else 0.0
        throttled_f = min(1.0, throttled / wall) if wall > 0 else 0.0
        f = max(delay_f, throttled_f)
        starved = f >= self.starved_fraction
        if self._since_probe is not None:
            self._since_probe += wall
            if not starved and self._starved == 0 and self._since_probe >= self.probation_s:
                self.hold = self.hold_s  # the probe held: whatever took the CPU has gone
                self._since_probe = None
        if starved:
            self._starved += 1
            self._quiet = 0.0
            if self._starved >= self.confirm and self.threads > 1:
                reason = REASON_THROTTLED if throttled_f >= self.starved_fraction else REASON_RUN_DELAY
                if self._since_probe is not None:  # the probe brought the wait back: hold longer next time
                    self.hold = min(self.max_hold_s, self.hold * 2)
                    self._since_probe = None
                return self._change(max(1, self.threads - max(1, round(self.threads * f))), reason, f)
            return None
        if f < self.quiet_fraction:
            self._starved = 0
            if self.threads < self.budget:
                self._quiet += wall
                if self._quiet >= self.hold:
                    self._since_probe = 0.0
                    return self._change(min(self.budget, self.threads * 2), REASON_PROBE, f)
        return None

    def _new_window(self) -> None:
        self._wall = self._delay = self._throttled = 0.0
        self._steps = 0

    def _change(self, threads: int, reason: str, fraction: float) -> ThreadChange:
        change = ThreadChange(threads, self.threads, reason, fraction)
        self.threads = threads
        self._starved = 0
        self._quiet = 0.0
        self._new_window()
        return change


def _throttled_seconds(text: str) -> float:
    """Throttled time in a cgroup cpu.stat: v2 `throttled_usec`, v1 `throttled_time` (ns); 0 when neither."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "throttled_usec":
            return int(value) / 1e6
        if key == "throttled_time":
            return int(value) / 1e9
    return 0.0


class CpuSignals:
    """Cumulative waits for `ThreadPolicy`, read on the engine thread: `read()` -> (run-queue delay of the
    calling thread, throttled time of the binding cgroup), both in seconds. Files stay open (one pread each
    per read); a file that cannot be read gives 0 from then on, never an error."""

    def __init__(self, cpu_stat: Path | None) -> None:
        self._cpu_stat = cpu_stat  # cpu.stat of the cgroup whose quota binds; None = no quota
        self._tid = 0  # the thread whose schedstat `_sched` reads
        self._sched: int | None = None
        self._stat: int | None = None
        if cpu_stat is not None:
            try:
                self._stat = os.open(cpu_stat, os.O_RDONLY)
            except OSError:
                self._stat = None

    def read(self) -> tuple[float, float]:
        tid = threading.get_native_id()
        if tid != self._tid:  # first read, or another thread steps now: its own file
            self._close_sched()
            self._tid = tid
            try:
                self._sched = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                self._sched = None
        delay = throttled = 0.0
        if self._sched is not None:
            try:
                delay = int(os.pread(self._sched, 128, 0).split()[1]) / 1e9
            except (OSError, IndexError, ValueError):
                self._close_sched()
        if self._stat is not None:
            try:
                throttled = _throttled_seconds(os.pread(self._stat, 1024, 0).decode())
            except (OSError, ValueError):
                os.close(self._stat)
                self._stat = None
        return delay, throttled

    def _close_sched(self) -> None:
        if self._sched is not None:
            os.close(self._sched)
            self._sched = None

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        self._close_sched()
        if self._stat is not None:
            os.close(self._stat)
            self._stat = None
