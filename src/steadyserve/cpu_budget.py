"""How many CPUs this process may use, and so how many intra-op threads torch runs with.

Read once at start-up, like the memory limit (memory.py), from:

* the cgroup CPU quota: v2 `cpu.max` ("QUOTA PERIOD", or "max PERIOD" for none), or v1 `cpu.cfs_quota_us` /
  `cpu.cfs_period_us` (quota -1 = none), of the process's own cgroup (found through /proc/self/cgroup and
  /proc/self/mountinfo) and of its ancestors up to the mount, since a parent's quota binds its children too;
  the smallest quota / period wins;
* the CPU affinity mask, os.sched_getaffinity(0) (taskset, cpuset, Kubernetes' static CPU manager);
* os.cpu_count(), when the OS cannot give the mask;
* the operator's `--threads`.

The default is the smallest of the quota (rounded down, at least 1) and the affinity mask: a thread pool wider
than the quota is throttled by the kernel (CFS) in the middle of a step, and one wider than the mask shares
cores. `--threads` wins when given, even above the quota; `CpuBudget.warning` then names the quota.

Pure Python (no torch import). TEST-ONLY: every file is read under `root` (default "/"); the affinity and CPU
count can be passed in, so fixture trees in tests decide everything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cgroups import cgroup_dir, cgroup_mounts, own_cgroups, read_file


@dataclass(frozen=True)
class CpuQuota:
    cpus: float | None  # quota / period: CPUs the smallest quota up the tree allows per period; None = no quota
    threads: int  # that quota as threads: rounded down, at least 1; 0 when there is no quota
    detail: str  # e.g. "cgroup v2 cpu.max 150000/100000 at /sys/fs/cgroup/a", or why there is no quota
    directory: Path | None = None  # the cgroup directory whose quota binds (its cpu.stat counts the throttling)


@dataclass(frozen=True)
class CpuBudget:
    threads: int  # intra-op threads torch runs with: --threads if given, else min(quota threads, affinity)
    source: str  # one line naming what decided `threads` (a quota's file, the affinity mask or --threads N)
    quota: float | None  # CPUs the cgroup quota allows (CpuQuota.cpus); None = no quota
    quota_detail: str  # where the quota was read, or why there is none (CpuQuota.detail)
    affinity: int | None  # CPUs this process may run on (os.sched_getaffinity(0)); None where the OS cannot say
    cpu_count: int  # logical CPUs the OS reports (os.cpu_count())
    flag: int  # --threads as given; 0 = not given
    warning: str = ""  # set when --threads is above the quota or the affinity mask: the line to log; "" otherwise

    def as_dict(self) -> dict[str, Any]:
        """The facts /v1/models and gRPC PlatformInfo report (0 = no quota / unknown mask)."""
        return {"threads": self.threads, "threads_source": self.source, "cpu_quota": self.quota or 0.0,
                "cpu_affinity": self.affinity or 0}


def cpus(n: float) -> str:
    """`1 CPU`, `1.5 CPUs`, `4 CPUs`."""
    return f"{n:g} CPU" + ("" if n == 1 else "s")


def _quota_in(d: Path, v2: bool) -> tuple[int, int] | None:
    """(quota, period) in microseconds set in cgroup directory `d`; None for no quota or no file."""
    if v2:
        fields = (read_file(d, "cpu.max") or "max").split()
        if fields[0] == "max":
            return None
        quota, period = int(fields[0]), int(fields[1]) if len(fields) > 1 else 100000
    else:
        text = read_file(d, "cpu.cfs_quota_us")
        if text is None or int(text) < 0:  # -1: no quota
            return None
        quota, period = int(text), int(read_file(d, "cpu.cfs_period_us") or "100000")
    return (quota, period) if quota > 0 and period > 0 else None


def _quota_term(root: Path, v2: bool, cg_path: str | None,
                mounts: list[tuple[str, str, str, str]]) -> tuple[int, int, str, Path] | None:
    """The smallest (quota, period, detail, directory) of our cgroup and its ancestors up to the mount, in one
    hierarchy."""
    found = cgroup_dir(root, mounts, v2, cg_path, controller="cpu") if cg_path is not None else None
    if found is None:
        return None
    d, base = found
    files = "cpu.max" if v2 else "cpu.cfs_quota_us/cpu.cfs_period_us"
    best: tuple[int, int, str, Path] | None = None
    while True:  # up to the mount point: an ancestor's quota binds us as well
        qp = _quota_in(d, v2)
        if qp is not None and (best is None or qp[0] * best[1] < best[0] * qp[1]):
            where = "/" + str(d.relative_to(root))
            best = (qp[0], qp[1], f"cgroup {'v2' if v2 else 'v1'} {files} {qp[0]}/{qp[1]} at {where}", d)
        if d == base or base not in d.parents:
            return best
        d = d.parent


def read_cpu_quota(root: str | Path = "/") -> CpuQuota:
    """The smallest CPU quota of this process's cgroups, v2 and v1, own and ancestors (files under `root`)."""
    base = Path(root)
    own, mounts = own_cgroups(base), cgroup_mounts(base)
    terms = [t for t in (_quota_term(base, True, own.get("v2"), mounts),
                         _quota_term(base, False, own.get("cpu"), mounts)) if t is not None]
    if not terms:
        return CpuQuota(None, 0, "no cgroup CPU quota (cpu.max / cpu.cfs_quota_us unset, max or -1)")
    quota, period, detail, directory = min(terms, key=lambda t: t[0] / t[1])
    return CpuQuota(quota / period, max(1, quota // period), detail, directory)


def _affinity() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None


def read_cpu_budget(flag: int = 0, root: str | Path = "/", affinity: int | None = -1,
                    cpu_count: int | None = None) -> CpuBudget:
    """The thread count to run with and why. `flag` is --threads (0 = choose). `root`, `affinity` and `cpu_count`
    are TEST-ONLY overrides: files under `root`; `affinity` -1 reads os.sched_getaffinity(0), None means the OS
    cannot say; `cpu_count` None reads os.cpu_count()."""
    q = read_cpu_quota(root)
    mask = _affinity() if affinity == -1 else affinity
    count = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    threads = mask if mask else count
    what = f"CPU affinity: {mask} of {cpus(count)} (sched_getaffinity)" if mask else f"os.cpu_count() {count}"
    if q.cpus is not None and q.threads <= threads:
        threads = q.threads
        rounded = "rounded down" if q.cpus > 1 else "at least 1"
        what = q.detail + ("" if q.cpus == q.threads else f" ({cpus(q.cpus)}, {rounded})")
    warning = ""
    if flag:
        above = []  # --threads 1 under a quota below one CPU is as low as it goes: no warning
        if q.cpus is not None and flag > max(q.cpus, 1):
            above.append(f"the cgroup CPU quota of {cpus(q.cpus)} ({q.detail})")
        if mask and flag > mask:
            above.append(f"the {cpus(mask)} of the affinity mask")
        if above:
            warning = (f"--threads {flag} is above {' and '.join(above)}: the pool is throttled or shares cores "
                       f"in the middle of a step; without --threads it would be {threads} ({what})")
        threads, what = flag, f"--threads {flag}"
    return CpuBudget(threads, what, q.cpus, q.detail, mask, count, flag, warning)
