"""`steadyserve validate` and `steadyserve bench` against real servers (issue 7).

validate must pass on a batch-invariant server and must fail on a server whose invariance is broken on
purpose (steadyserve.testing.serve --test-drift: it claims -bi and drifts by the step's token count); against a
--no-batch-invariant server it reports whatever this machine's plain kernels do (printed, plus the nbi
fingerprint it must see). bench must count streams, and count a stream that was cut without a finish
reason: a proxy that cuts every other stream cleanly shows that, over SSE, WebSocket and gRPC.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpc_util import GrpcCuttingProxy
from http_util import CuttingProxy
from steadyserve.testing.server import ServerProcess


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "steadyserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def invariant_server(sw_invariant: ServerProcess):
    return sw_invariant


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


def test_validate_catches_a_broken_invariant(sw_drift: ServerProcess) -> None:
    r = cli("validate", "--http", sw_drift.http_url, "--grpc", sw_drift.grpc_addr, "-n", "48", "-c", "16",
            "--background", "1", "--json")
    rep = json.loads(r.stdout)
    assert r.returncode == 1, r.stdout + r.stderr
    assert not rep["passed"]
    worst = max(g["distinct_vectors"] for k in rep["kinds"].values() for g in k["fingerprints"].values())
    assert worst > 1
    # It claims invariance (-bi) while it drifts: exactly what validate exists to catch.
    assert all(fp.endswith("-bi") for k in rep["kinds"].values() for fp in k["fingerprints"])


def test_validate_against_plain_server(sw_plain: ServerProcess) -> None:
    """Nothing is promised without invariance: validate must see the -nbi fingerprint and report what it
    found. Whether this machine's plain kernels drift under validate's load is printed, not asserted (the
    search for a plain-path drift is in tests/test_invariance_api.py)."""
    r = cli("validate", "--http", sw_plain.http_url, "-n", "64", "-c", "32", "--background", "1", "--json")
    rep = json.loads(r.stdout)
    worst = max(g["distinct_vectors"] for k in rep["kinds"].values() for g in k["fingerprints"].values())
    print(f"\nvalidate on the plain server: passed={rep['passed']}, worst distinct vectors {worst}")
    assert rep["errors"] == 0
    assert all(fp.endswith("-nbi") for k in rep["kinds"].values() for fp in k["fingerprints"])
    assert r.returncode == (0 if rep["passed"] else 1) and rep["passed"] == (worst == 1)


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


@pytest.mark.parametrize("transport", ["sse", "ws"])
def test_bench_counts_a_cut_stream_as_truncated(invariant_server: ServerProcess, transport: str,
                                                tmp_path: Path) -> None:
    """Through a proxy that ends every other stream cleanly after 3 events, with no finish reason."""
    out = tmp_path / "report.json"
    with CuttingProxy(invariant_server.http_port, keep=3) as proxy:
        r = cli("bench", "--url", proxy.url, "--transport", transport, "-c", "2", "-n", "6", "--output-tokens",
                "12-16", "--prompt-words", "4-8", "--disconnect", "0", "--slow-readers", "0", "--json",
                "--output", str(out))
    rep = json.loads(out.read_text())
    print(f"\nbench through the cutting proxy ({transport}): proxy cut {proxy.cut} of {proxy.streams} streams; "
          f"bench counted {rep['truncated_streams']} truncated; exit {r.returncode}")
    # Every other stream goes through the cut; one whose finish came within the first 3 events is whole (proxy.cut).
    assert proxy.streams == 6 and 1 <= proxy.cut <= 3
    assert rep["truncated_streams"] == proxy.cut
    assert r.returncode == 1  # bench fails the run when a stream was truncated
    assert sum(rep["finish_reasons"].values()) == 6 - proxy.cut


def test_bench_counts_a_cut_grpc_stream_as_truncated(invariant_server: ServerProcess, tmp_path: Path) -> None:
    """Through a gRPC proxy that ends every other Generate with OK after 3 messages and no `final`."""
    out = tmp_path / "report.json"
    with GrpcCuttingProxy(invariant_server.grpc_addr, keep=3) as proxy:
        r = cli("bench", "--grpc", proxy.addr, "--transport", "grpc", "-c", "2", "-n", "6", "--output-tokens",
                "12-16", "--prompt-words", "4-8", "--disconnect", "0", "--slow-readers", "0", "--ignore-eos",
                "--json", "--output", str(out))
    rep = json.loads(out.read_text())
    print(f"\nbench through the gRPC cutting proxy: proxy cut {proxy.cut} of {proxy.streams} streams; "
          f"bench counted {rep['truncated_streams']} truncated; exit {r.returncode}")
    # Every other stream goes through the cut; one whose finish came within the first 3 events is whole (proxy.cut).
    assert proxy.streams == 6 and 1 <= proxy.cut <= 3
    assert rep["truncated_streams"] == proxy.cut
    assert r.returncode == 1
    assert sum(rep["finish_reasons"].values()) == 6 - proxy.cut
