"""The platform facts (CPU model, the ISA PyTorch dispatches to, MKL version and MKL_CBWR, the verified
row-tile ladder) are the same in `steadyserve info`, HTTP GET /v1/models and gRPC GetModelInfo, and they are
this machine's: compared with what the test process itself reads, not with constants."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest
import torch

from steadyserve.client import Client
from steadyserve.config import EngineConfig
from steadyserve.models.loader import load_model
from steadyserve.numerics import describe
from steadyserve.platform_info import platform_info, row_tiles_of
from steadyserve.testing.server import ServerProcess

CBWR = "AUTO,STRICT"  # set for the child processes only; they must report it back


@pytest.fixture(scope="module")
def cbwr_server(tiny_model: str):
    with ServerProcess(tiny_model, "--numerics", "host", env={"MKL_CBWR": CBWR}, threads=1) as s:
        yield s


def test_platform_info_reads_this_machine():
    p = platform_info([4, 64])
    assert p.isa == torch.backends.cpu.get_cpu_capability() and p.isa
    assert p.torch_version == torch.__version__
    with open("/proc/cpuinfo") as f:
        names = {line.split(":", 1)[1].strip() for line in f if line.startswith("model name")}
    assert p.cpu_model in names
    assert (p.mkl_version != "") == torch.backends.mkl.is_available()
    assert p.row_tiles == (4, 64) and platform_info().row_tiles == ()


def test_info_prints_platform_facts(tiny_model: str):
    r = subprocess.run([sys.executable, "-m", "steadyserve.cli", "info", "--model", tiny_model, "--threads", "1",
                        "--numerics", "host"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "MKL_CBWR": CBWR})
    assert r.returncode == 0, r.stdout + r.stderr
    out = {m.group(1): m.group(2) for m in re.finditer(r"^(\S+(?: \S+)?)\s{2,}(.*)$", r.stdout, re.M)}
    me = platform_info()
    assert out["cpu"].startswith(me.cpu_model + " ("), r.stdout
    assert out["isa"].startswith(me.isa + " "), r.stdout
    assert f"MKL_CBWR={CBWR}" in out["mkl"] and me.mkl_version in out["mkl"], r.stdout
    # The ladder the self-test verified in that process: ascending, ending at the configured --row-tile.
    assert out["self-test"].startswith("bitwise equal"), r.stdout
    assert re.match(r"[\d.]+ [KMGT]iB \(.+\)$", out["memory limit"]), r.stdout  # the limit and its source
    assert "weights " in out["memory"] and " of limit " in out["memory"], r.stdout
    assert out["threads"].startswith("1 (--threads 1; cgroup CPU quota "), r.stdout
    tiles = [int(t) for t in out["row tiles"].strip("[]").split(", ")]
    assert tiles == sorted(tiles) and tiles[-1] == EngineConfig().row_tile, r.stdout


def test_http_and_grpc_report_the_same_platform(cbwr_server: ServerProcess):
    http = httpx.get(cbwr_server.http_url + "/v1/models", timeout=30).json()["data"][0]["platform"]
    with Client(cbwr_server.grpc_addr, timeout=30, retries=False) as c:
        info = c.model_info()
        g = info.platform
    grpc_view = {"cpu_model": g.cpu_model, "cpu_flags": list(g.cpu_flags), "num_cpus": g.num_cpus, "isa": g.isa,
                 "torch_version": g.torch_version, "mkl_version": g.mkl_version, "mkl_cbwr": g.mkl_cbwr,
                 "mkl_enable_instructions": g.mkl_enable_instructions, "row_tiles": list(g.row_tiles),
                 "numerics": g.numerics, "numerics_id": g.numerics_id,
                 "memory_limit_bytes": g.memory_limit_bytes, "memory_limit_source": g.memory_limit_source,
                 "threads": g.threads, "threads_source": g.threads_source, "cpu_quota": g.cpu_quota,
                 "cpu_affinity": g.cpu_affinity}
    assert http == grpc_view
    assert http["memory_limit_bytes"] > 0 and http["memory_limit_source"]  # read at start-up, with its source
    # The CPU budget: the server was started with --threads 1, which decides whatever the quota says.
    assert (http["threads"], http["threads_source"]) == (1, "--threads 1")
    assert http["cpu_affinity"] == len(os.sched_getaffinity(0))
    # The numerics id is the fingerprint's, and it hashes the server's own environment (its MKL_CBWR).
    assert http["numerics"] == "host" and f"-{http['numerics_id']}-" in info.fingerprint
    facts = {k: http[k] for k in ("isa", "cpu_model", "torch_version", "mkl_version", "mkl_cbwr",
                                  "mkl_enable_instructions")}
    assert describe("host", cpu_flags=tuple(http["cpu_flags"]), **facts).numerics_id == http["numerics_id"]
    me = platform_info().as_dict()
    for k in ("cpu_model", "cpu_flags", "num_cpus", "isa", "torch_version", "mkl_version"):
        assert http[k] == me[k], k
    assert http["mkl_cbwr"] == CBWR  # the server's own environment, not ours
    # The tile ladder is the one the server's start-up self-test verified: ascending, ending at --row-tile.
    assert http["row_tiles"] == sorted(http["row_tiles"]) and http["row_tiles"][-1] == EngineConfig().row_tile


def test_row_tiles_empty_without_invariance_or_calibration(tiny_model: str):
    assert row_tiles_of(load_model(tiny_model, batch_invariant=False)) == ()
    # host path before calibration: the full tile only
    assert row_tiles_of(load_model(tiny_model, numerics="host")) == (EngineConfig().row_tile,)
    # portable path: nothing to calibrate, rows are independent by construction
    assert row_tiles_of(load_model(tiny_model)) == ()
