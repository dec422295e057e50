"""`steadyserve validate` and `steadyserve bench` against real servers (issue 7).

validate must pass on a batch-invariant server and must catch drift on the
same model served with --no-batch-invariant (SmolLM2 layer widths, where plain
GEMMs vary with the row count). bench must count streams and truncations.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from steadyserve.testing.server import ServerProcess


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "steadyserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def invariant_server(smolwidth_model: str):
    with ServerProcess(smolwidth_model, "--max-num-seqs", "32") as s:
        yield s


@pytest.fixture(scope="module")
def plain_server(smolwidth_model: str):
    with ServerProcess(smolwidth_model, "--max-num-seqs", "32", "--no-batch-invariant") as s:
        yield s


def test_validate_passes_on_invariant_server(invariant_server: ServerProcess) -> None:
    # Fewer clients than seats (32), so steps are not all full and their sizes differ.
    r = cli("validate", "--http", invariant_server.http_url, "--grpc", invariant_server.grpc_addr,
            "-n", "96", "-c", "16", "--background", "1", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert rep["passed"] and rep["errors"] == 0
    sizes = set()
    for kind in ("score", "generate"):
        (fp, g), = rep["kinds"][kind]["fingerprints"].items()
        assert fp.endswith("-bi")
        assert g["distinct_vectors"] == 1 and g["max_abs_drift"] == 0
        assert set(g["by_transport"]) == {"http", "grpc"}
        b = rep["kinds"][kind]["batch_seqs"]
        assert b["max"] > 4  # the probes really did share their steps with other sequences
        sizes |= {b["min"], b["max"]}
    assert len(sizes) > 1  # ...and not always with the same number of them


def test_validate_catches_drift_without_invariance(plain_server: ServerProcess) -> None:
    r = cli("validate", "--http", plain_server.http_url, "-n", "64", "-c", "32", "--background", "1", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert not rep["passed"]
    worst = max(g["distinct_vectors"] for k in rep["kinds"].values() for g in k["fingerprints"].values())
    assert worst > 1
    assert any(fp.endswith("-nbi") for k in rep["kinds"].values() for fp in k["fingerprints"])


def test_validate_human_summary(invariant_server: ServerProcess) -> None:
    r = cli("validate", "--http", invariant_server.http_url, "-n", "8", "-c", "8", "--background", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "distinct logprob vector" in r.stdout


@pytest.mark.parametrize("transport", ["sse", "ws", "grpc"])
def test_bench_counts_streams_disconnects_and_truncations(invariant_server: ServerProcess, transport: str,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    args = ["bench", "--url", invariant_server.http_url, "--grpc", invariant_server.grpc_addr, "--transport",
            transport, "-c", "12", "-n", "24", "--output-tokens", "8-24", "--prompt-words", "4-16",
            "--disconnect", "0.25", "--slow-readers", "0.2", "--slow-rate", "20000", "--json", "--output", str(out)]
    if transport == "sse":
        args += ["--plot", str(tmp_path / "plots")]
    r = cli(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert rep["requests"] == 24 and rep["truncated_streams"] == 0
    assert rep["output_tokens"] > 0 and rep["ttft_s"]["p50"] is not None and rep["e2e_s"]["p99"] is not None
    assert rep["roles"].get("disconnect", 0) + rep["roles"].get("slow", 0) + rep["roles"].get("normal", 0) == 24
    # Every stream either finished with a reason or was hung up on by a "disconnect" client
    # (one whose cut point came after its last event finishes normally).
    finished = sum(rep["finish_reasons"].values())
    assert finished + rep["disconnected"] == 24
    assert 0 < rep["disconnected"] <= rep["roles"].get("disconnect", 0)
    if transport == "sse":
        assert all(Path(p).stat().st_size > 1000 for p in rep["plots"])


def test_bench_scoring_open_loop(invariant_server: ServerProcess) -> None:
    r = cli("bench", "--url", invariant_server.http_url, "--mode", "score", "--rate", "20", "--duration", "2",
            "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 0
    assert rep["requests"] >= 20 and set(rep["status"]) == {"200"}
