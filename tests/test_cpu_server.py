"""The CPU budget against real processes under a real 1-CPU cgroup quota (issue 40), made by the test
(steadyserve/testing/cgroups.py; root and a writable cgroup mount, else a skip that says why):

* a server started without a thread count (`--threads 0`) runs 1 thread, and /v1/models, gRPC GetModelInfo,
  `steadyserve_threads` / `steadyserve_cpu_quota_cpus` and its start-up log say so with the quota's file;
* `steadyserve info --threads 2` in the same cgroup keeps 2 threads, prints them, and warns naming the quota.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Iterator

import httpx
import pytest

from steadyserve.client import Client
from steadyserve.testing.cgroups import CgroupUnavailable, QuotaCgroup, cpu_quota_cgroup
from steadyserve.testing.server import ServerProcess


@pytest.fixture(scope="module")
def one_cpu() -> Iterator[QuotaCgroup]:
    try:
        with cpu_quota_cgroup(100000) as cg:  # 100 ms per 100 ms period: 1 CPU
            yield cg
    except CgroupUnavailable as e:
        pytest.skip(f"cannot make a cgroup with a CPU quota on this machine: {e}")


def quota_source(cg: QuotaCgroup) -> str:
    files = "cpu.max" if cg.version == 2 else "cpu.cfs_quota_us/cpu.cfs_period_us"
    return f"cgroup v{cg.version} {files} 100000/100000 at {cg.path}"


@pytest.fixture(scope="module")
def quota_server(tiny_model: str, one_cpu: QuotaCgroup) -> Iterator[ServerProcess]:
    with ServerProcess(tiny_model, "--stall-timeout", "10", threads=0, cgroup=str(one_cpu.path)) as s:
        yield s


def test_server_under_a_one_cpu_quota_runs_and_reports_one_thread(quota_server: ServerProcess,
                                                                  one_cpu: QuotaCgroup):
    assert f"/{one_cpu.path.name}\n" in open(f"/proc/{quota_server.pid}/cgroup").read()  # it runs in the cgroup
    source = quota_source(one_cpu)
    platform = httpx.get(quota_server.http_url + "/v1/models", timeout=30).json()["data"][0]["platform"]
    assert (platform["threads"], platform["threads_source"], platform["cpu_quota"]) == (1, source, 1.0)
    assert platform["cpu_affinity"] == len(os.sched_getaffinity(0))
    with Client(quota_server.grpc_addr, timeout=30, retries=False) as c:
        g = c.model_info().platform
    assert (g.threads, g.threads_source, g.cpu_quota, g.cpu_affinity) == (1, source, 1.0, platform["cpu_affinity"])
    assert quota_server.metric("steadyserve_threads") == 1 == quota_server.metric("steadyserve_threads_budget")
    assert quota_server.metric("steadyserve_cpu_quota_cpus") == 1.0
    logs = quota_server.logs()
    assert re.search(r"cpu budget .*threads=1\b", logs), logs[-3000:]
    assert re.search(r"kv cache allocated .*threads=1\b", logs), logs[-3000:]  # torch's own count on the model thread
    assert "is above the cgroup CPU quota" not in logs
    # And it serves.
    r = httpx.post(quota_server.http_url + "/v1/completions", timeout=60,
                   json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_info_with_threads_above_the_quota_keeps_them_and_warns_naming_it(tiny_model: str, one_cpu: QuotaCgroup):
    argv = [sys.executable, "-m", "steadyserve.cli", "info", "--model", tiny_model, "--threads", "2"]
    r = subprocess.run(one_cpu.wrap(argv), capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stdout + r.stderr
    out = {m.group(1): m.group(2) for m in re.finditer(r"^(\S+(?: \S+)?)\s{2,}(.*)$", r.stdout, re.M)}
    assert out["threads"].startswith("2 (--threads 2; cgroup CPU quota 1 CPU, affinity "), r.stdout
    source = quota_source(one_cpu)
    assert f"--threads 2 is above the cgroup CPU quota of 1 CPU ({source})" in r.stdout + r.stderr, r.stderr
