"""TEST-ONLY: a real cgroup of the test's own with a CPU quota, to run a process (a probe, a server) under it.

cgroup v2 is used where its mount's root enables the cpu controller for children (`cpu` in
cgroup.subtree_control), else the cgroup v1 `cpu` hierarchy. Creating a cgroup needs root and a writable cgroup
mount (a container needs its own cgroup namespace or --privileged); where that is missing, `CgroupUnavailable`
says exactly what is, so the test that needed it can skip with the reason (a listed skip, an error in CI).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..cgroups import cgroup_mounts

PERIOD_US = 100000  # the kernel's default CFS period
# `sh -c JOIN_AND_EXEC CGROUP_DIR ARGV...`: the shell moves itself into the cgroup, then execs ARGV (same pid).
JOIN_AND_EXEC = 'echo $$ > "$0/cgroup.procs" && exec "$@"'


class CgroupUnavailable(RuntimeError):
    """No cgroup with a CPU quota can be made here; the message says why, for each hierarchy tried."""


@dataclass(frozen=True)
class QuotaCgroup:
    path: Path  # the cgroup processes join (its cgroup.procs)
    quota_dir: Path  # the cgroup whose quota binds them: `path` itself, or its parent when nested
    version: int  # 1 or 2

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run by a shell that first moves itself into this cgroup, then execs it (same pid)."""
        return ["sh", "-c", JOIN_AND_EXEC, str(self.path), *argv]


def _hierarchies() -> tuple[list[tuple[int, Path]], list[str]]:
    """Where a cgroup with a CPU quota could be made: [(version, mount point)], and why the others cannot."""
    found: list[tuple[int, Path]] = []
    why: list[str] = []
    mounts = cgroup_mounts(Path("/"))
    v2 = [Path(p) for _, p, fs, _ in mounts if fs == "cgroup2"]
    v1 = [Path(p) for _, p, fs, opts in mounts if fs == "cgroup" and "cpu" in opts.split(",")]
    for m in v2:
        control = _text(m / "cgroup.subtree_control")
        if "cpu" in control.split():
            found.append((2, m))
        else:
            why.append(f"cgroup v2 at {m}: the cpu controller is not enabled for children (cgroup.subtree_control "
                       f"{control.strip()!r}; cgroup.controllers {_text(m / 'cgroup.controllers').strip()!r})")
    found += [(1, m) for m in v1]
    if not v1:
        why.append("no cgroup v1 cpu hierarchy in /proc/self/mountinfo")
    if os.geteuid() != 0:
        why.insert(0, f"not root (euid {os.geteuid()}): creating a cgroup needs root or a delegated subtree")
        found = []
    return found, why


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        return f"<unreadable: {e.strerror}>"


def _set_quota(d: Path, version: int, quota_us: int) -> None:
    if version == 2:
        (d / "cpu.max").write_text(f"{quota_us} {PERIOD_US}\n")
    else:
        (d / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
        (d / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")


def _remove(d: Path) -> None:
    """rmdir a cgroup once its processes are gone (a reaped child leaves it at once; allow for stragglers)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY while a process is still in it
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@contextmanager
def cpu_quota_cgroup(quota_us: int, nested: bool = False) -> Iterator[QuotaCgroup]:
    """A new cgroup with `quota_us` per 100 ms period (100000 = 1 CPU), removed on exit once its processes are
    gone (the caller stops them). `nested`: the quota is set on a new parent and processes join a child of it
    with no quota of its own, so only a reader that walks up the tree sees it. Raises CgroupUnavailable."""
    found, why = _hierarchies()
    name = f"steadyserve-test-{os.getpid()}-{time.monotonic_ns()}"
    for version, mount in found:
        top = mount / name
        made: list[Path] = []
        try:
            top.mkdir()
            made.append(top)
            _set_quota(top, version, quota_us)
            path = top
            if nested:
                if version == 2:
                    (top / "cgroup.subtree_control").write_text("+cpu\n")
                path = top / "child"
                path.mkdir()
                made.append(path)
        except OSError as e:
            why.append(f"cgroup v{version} at {mount}: {e.strerror} ({e.filename})")
            for d in reversed(made):
                _remove(d)
            continue
        try:
            yield QuotaCgroup(path, top, version)
        finally:
            for d in reversed(made):
                _remove(d)
        return
    raise CgroupUnavailable("; ".join(why) or "no cgroup hierarchy found")
