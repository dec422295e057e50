"""The CPU budget (issue 40), without a server: cgroup v2 `cpu.max` and v1 `cpu.cfs_quota_us` read from fixture
trees (`read_cpu_budget(root=..., affinity=..., cpu_count=...)`), nested parents, `max` / -1, fractional quotas,
the affinity mask and `--threads`; then the same reader in a process under a real cgroup this test makes
(steadyserve/testing/cgroups.py). The server under a real quota is in test_cpu_server.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from steadyserve.cli import build_parser, config_from_args
from steadyserve.config import ConfigError, EngineConfig
from steadyserve.cpu_budget import CpuBudget, read_cpu_budget, read_cpu_quota
from steadyserve.metrics import Metrics
from steadyserve.platform_info import platform_info
from steadyserve.testing.cgroups import CgroupUnavailable, cpu_quota_cgroup

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
V1_FILES = "cpu.cfs_quota_us/cpu.cfs_period_us"
NO_QUOTA = "no cgroup CPU quota (cpu.max / cpu.cfs_quota_us unset, max or -1)"


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def v2(root: Path, cgroup: str, cpu_max: dict[str, str]) -> Path:
    """A cgroup v2 tree: we are in `cgroup`; `cpu_max` maps cgroup paths to their cpu.max."""
    files = {"proc/self/cgroup": f"0::{cgroup}\n", "proc/self/mountinfo": V2_MOUNT}
    files.update({f"sys/fs/cgroup{p}/cpu.max".replace("//", "/"): v for p, v in cpu_max.items()})
    return tree(root, files)


def budget(root: Path, flag: int = 0, affinity: int | None = 8) -> CpuBudget:
    return read_cpu_budget(flag, root=root, affinity=affinity, cpu_count=16)


# ---- (a) fixture trees ---------------------------------------------------------------------------------------

def test_v2_own_quota_rounds_down_and_names_its_file(tmp_path):
    root = v2(tmp_path, "/kubepods/pod1/ctr", {"/kubepods/pod1/ctr": "150000 100000\n", "/kubepods": "max 100000\n"})
    b = budget(root)
    assert (b.threads, b.quota, b.affinity, b.cpu_count, b.flag, b.warning) == (1, 1.5, 8, 16, 0, "")
    assert b.quota_detail == "cgroup v2 cpu.max 150000/100000 at /sys/fs/cgroup/kubepods/pod1/ctr"
    assert b.source == b.quota_detail + " (1.5 CPUs, rounded down)"


def test_v2_smaller_parent_binds_the_child(tmp_path):
    root = v2(tmp_path, "/a/b/c", {"/a/b/c": "400000 100000\n", "/a/b": "200000 100000\n", "/a": "300000 100000\n"})
    b = budget(root)
    assert (b.threads, b.quota) == (2, 2.0)
    assert b.source == "cgroup v2 cpu.max 200000/100000 at /sys/fs/cgroup/a/b"  # whole CPUs: no rounding note
    # The child's own quota smaller again: it wins.
    (root / "sys/fs/cgroup/a/b/c/cpu.max").write_text("100000 100000\n")
    assert budget(root).source == "cgroup v2 cpu.max 100000/100000 at /sys/fs/cgroup/a/b/c"


def test_v2_max_everywhere_is_no_quota_and_the_affinity_decides(tmp_path):
    root = v2(tmp_path, "/a/b", {"/a/b": "max 100000\n", "/a": "max\n"})
    assert read_cpu_quota(root).cpus is None
    b = budget(root, affinity=4)
    assert (b.threads, b.quota, b.quota_detail) == (4, None, NO_QUOTA)
    assert b.source == "CPU affinity: 4 of 16 CPUs (sched_getaffinity)"


def test_a_quota_below_one_cpu_is_one_thread(tmp_path):
    b = budget(v2(tmp_path, "/", {"/": "50000 100000\n"}))  # a namespaced mount: our cgroup is its root
    assert (b.threads, b.quota) == (1, 0.5)
    assert b.source == "cgroup v2 cpu.max 50000/100000 at /sys/fs/cgroup (0.5 CPUs, at least 1)"


def test_affinity_smaller_than_the_quota_decides(tmp_path):
    root = v2(tmp_path, "/ctr", {"/ctr": "400000 100000\n"})
    b = budget(root, affinity=2)
    assert (b.threads, b.quota, b.source) == (2, 4.0, "CPU affinity: 2 of 16 CPUs (sched_getaffinity)")
    # A tie goes to the quota, the limit the operator set for this container.
    assert budget(root, affinity=4).source == "cgroup v2 cpu.max 400000/100000 at /sys/fs/cgroup/ctr"
    # No mask from the OS: the CPU count stands in for it.
    b = budget(v2(tmp_path / "none", "/", {}), affinity=None)
    assert (b.threads, b.affinity, b.source) == (16, None, "os.cpu_count() 16")


def test_v1_co_mounted_cpu_cpuacct_with_a_mount_root_and_minus_one(tmp_path):
    """cgroup v1, Docker without a namespace: the cpu,cpuacct mount's root is the container's own path."""
    mount = "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
    root = tree(tmp_path, {"proc/self/cgroup": "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n",
                           "proc/self/mountinfo": mount,
                           "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
                           "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    b = budget(root)
    assert (b.threads, b.quota) == (3, 3.0)
    assert b.source == f"cgroup v1 {V1_FILES} 300000/100000 at /sys/fs/cgroup/cpu,cpuacct"
    (root / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us").write_text("-1\n")
    b = budget(root)
    assert (b.threads, b.quota, b.quota_detail) == (8, None, NO_QUOTA)


def test_v1_smaller_parent_with_its_own_period(tmp_path):
    mount = "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    base = "sys/fs/cgroup/cpu"
    root = tree(tmp_path, {"proc/self/cgroup": "2:cpu:/a/b\n", "proc/self/mountinfo": mount,
                           f"{base}/a/b/cpu.cfs_quota_us": "-1\n", f"{base}/a/b/cpu.cfs_period_us": "100000\n",
                           f"{base}/a/cpu.cfs_quota_us": "125000\n", f"{base}/a/cpu.cfs_period_us": "50000\n",
                           f"{base}/cpu.cfs_quota_us": "-1\n", f"{base}/cpu.cfs_period_us": "100000\n"})
    b = budget(root)
    assert (b.threads, b.quota) == (2, 2.5)
    assert b.source == f"cgroup v1 {V1_FILES} 125000/50000 at /sys/fs/cgroup/cpu/a (2.5 CPUs, rounded down)"


def test_v1_without_mountinfo_uses_the_conventional_mount(tmp_path):
    root = tree(tmp_path, {"proc/self/cgroup": "2:cpu,cpuacct:/\n",
                           "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "200000\n",
                           "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"})
    assert budget(root).source == f"cgroup v1 {V1_FILES} 200000/100000 at /sys/fs/cgroup/cpu"


def test_hybrid_v1_and_v2_the_smaller_quota_wins(tmp_path):
    mounts = V2_MOUNT.replace("/sys/fs/cgroup ", "/sys/fs/cgroup/unified ") \
        + "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    root = tree(tmp_path, {"proc/self/cgroup": "1:cpu:/x\n0::/x\n", "proc/self/mountinfo": mounts,
                           "sys/fs/cgroup/unified/x/cpu.max": "300000 100000\n",
                           "sys/fs/cgroup/cpu/x/cpu.cfs_quota_us": "200000\n",
                           "sys/fs/cgroup/cpu/x/cpu.cfs_period_us": "100000\n"})
    assert budget(root).source == f"cgroup v1 {V1_FILES} 200000/100000 at /sys/fs/cgroup/cpu/x"
    (root / "sys/fs/cgroup/unified/x/cpu.max").write_text("100000 100000\n")
    assert budget(root).source == "cgroup v2 cpu.max 100000/100000 at /sys/fs/cgroup/unified/x"


def test_nothing_readable_is_no_quota(tmp_path):
    b = budget(tmp_path, affinity=3)
    assert (b.threads, b.quota, b.quota_detail) == (3, None, NO_QUOTA)


def test_threads_flag_wins_and_above_the_quota_is_a_warning_naming_it(tmp_path):
    root = v2(tmp_path, "/ctr", {"/ctr": "150000 100000\n"})
    b = budget(root, flag=4)
    assert (b.threads, b.source, b.flag, b.quota) == (4, "--threads 4", 4, 1.5)
    assert "--threads 4 is above the cgroup CPU quota of 1.5 CPUs (cgroup v2 cpu.max 150000/100000 at " \
           "/sys/fs/cgroup/ctr)" in b.warning
    assert "without --threads it would be 1" in b.warning
    assert budget(root, flag=1).warning == ""  # within the quota
    assert "affinity mask" in budget(root, flag=9).warning  # above the mask too
    # A quota below one CPU: --threads 1 is as low as it goes, nothing to warn about.
    assert budget(v2(tmp_path / "half", "/", {"/": "50000 100000\n"}), flag=1).warning == ""
    assert budget(v2(tmp_path / "none", "/", {}), flag=8).warning == ""  # no quota, the mask holds 8


def test_engine_config_default_is_the_budget_and_the_flag_is_validated():
    assert EngineConfig(threads=0).num_threads == read_cpu_budget().threads
    assert EngineConfig(threads=3).num_threads == 3
    with pytest.raises(ConfigError, match="--threads must be 0 .the CPU budget. or positive"):
        config_from_args(build_parser().parse_args(["serve", "--threads", "-1"]))


def test_budget_reaches_platform_info_and_the_gauges(tmp_path):
    b = budget(v2(tmp_path, "/ctr", {"/ctr": "150000 100000\n"}), affinity=2)
    d = platform_info(cpu=b).as_dict()
    assert {k: d[k] for k in ("threads", "threads_source", "cpu_quota", "cpu_affinity")} == {
        "threads": 1, "threads_source": b.source, "cpu_quota": 1.5, "cpu_affinity": 2}
    assert dict(platform_info(cpu=b).lines())["threads"] == (
        f"1 ({b.source}; cgroup CPU quota 1.5 CPUs, affinity 2 of {platform_info().num_cpus} CPUs)")
    assert dict(platform_info().lines())["threads"] == "unknown"
    m = Metrics("m", "fp", "cpu", "float32", True)
    m.set_cpu_budget(b.threads, b.quota)
    text = generate_latest(m.registry).decode()
    assert "\nsteadyserve_threads 1.0\n" in text and "\nsteadyserve_cpu_quota_cpus 1.5\n" in text
    assert "\nsteadyserve_threads_budget 1.0\n" in text  # the budget stays put when the engine runs fewer


# ---- (b) a real cgroup -----------------------------------------------------------------------------------------

PROBE = """
import json
from pathlib import Path
from steadyserve.config import EngineConfig
from steadyserve.cpu_budget import read_cpu_budget
b = read_cpu_budget()
print(json.dumps({"threads": b.threads, "source": b.source, "quota": b.quota, "engine": EngineConfig().num_threads,
                  "cgroup": Path("/proc/self/cgroup").read_text()}))
"""


@pytest.mark.parametrize("quota_us,nested", [(100000, False), (100000, True), (150000, False)],
                         ids=["own-1cpu", "parent-1cpu", "own-1.5cpu"])
def test_a_process_under_a_real_cpu_quota_gets_one_thread(quota_us: int, nested: bool):
    try:
        with cpu_quota_cgroup(quota_us, nested=nested) as cg:
            r = subprocess.run(cg.wrap([sys.executable, "-c", PROBE]), capture_output=True, text=True, timeout=60,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except CgroupUnavailable as e:
        pytest.skip(f"cannot make a cgroup with a CPU quota on this machine: {e}")
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout)
    # The probe ran in our cgroup (its path relative to the hierarchy's mount root shows in /proc/self/cgroup).
    assert f"/{cg.path.relative_to(cg.quota_dir.parent)}\n" in out["cgroup"], out["cgroup"]
    files = "cpu.max" if cg.version == 2 else V1_FILES
    expected = f"cgroup v{cg.version} {files} {quota_us}/100000 at {cg.quota_dir}"
    if quota_us != 100000:
        expected += f" ({quota_us / 100000:g} CPUs, rounded down)"
    assert (out["threads"], out["quota"], out["source"], out["engine"]) == (1, quota_us / 100000, expected, 1)
