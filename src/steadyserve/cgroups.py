"""Where this process's cgroups are: /proc/self/cgroup and /proc/self/mountinfo, read once per question.

Shared by the memory limit (memory.py) and the CPU budget (cpu_budget.py). Every function takes `root`,
the directory standing for "/", so tests can point it at a fake tree. Imports nothing of the package.
"""

from __future__ import annotations

from pathlib import Path


def read_file(root: Path, path: str) -> str | None:
    """The text of `path` under `root`, or None when it cannot be read."""
    try:
        return (root / path.lstrip("/")).read_text()
    except OSError:
        return None


def own_cgroups(root: Path) -> dict[str, str]:
    """/proc/self/cgroup as {"v2": path, controller: path, ...}: the line `0::/path` is "v2", and each v1 line
    `N:cpu,cpuacct:/path` gives every controller it names ("memory", "cpu", ...) that path."""
    out: dict[str, str] = {}
    for line in (read_file(root, "/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            out["v2"] = parts[2]
        else:
            for controller in parts[1].split(","):
                out[controller] = parts[2]
    return out


def cgroup_mounts(root: Path) -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fs type, super options) of each cgroup mount in /proc/self/mountinfo."""
    out = []
    for line in (read_file(root, "/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) >= 5 and len(r) >= 3 and r[0] in ("cgroup", "cgroup2"):
            out.append((f[3], f[4], r[0], r[2]))
    return out


def cgroup_dir(root: Path, mounts: list[tuple[str, str, str, str]], v2: bool,
               cg_path: str, controller: str = "memory") -> tuple[Path, Path] | None:
    """(our cgroup's directory, its mount point): the mount point plus our path relative to the mount's root.
    v1 looks for the mount of `controller`; v2 has one hierarchy for all of them."""
    for mroot, mpoint, fstype, opts in mounts:
        if (fstype == "cgroup2") != v2 or (not v2 and controller not in opts.split(",")):
            continue
        rel = cg_path[len(mroot):] if cg_path.startswith(mroot) else cg_path
        base = root / mpoint.lstrip("/")
        d = base / rel.lstrip("/")
        return (d if d.is_dir() else base), base  # a namespaced mount shows our cgroup as its root
    # No mountinfo (minimal fixtures, odd containers): the conventional mount points.
    base = root / ("sys/fs/cgroup" if v2 else f"sys/fs/cgroup/{controller}")
    if not base.is_dir():
        return None
    d = base / cg_path.lstrip("/")
    return (d if d.is_dir() else base), base
