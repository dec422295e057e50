"""Several replicas behind nginx on 127.0.0.1 (scripts/cluster_demo.py, as `make cluster-demo` runs it).

Two real replicas with the tiny model, nginx from Debian's package in front (installed with
apt-get when missing and running as root, as CI does; otherwise skipped with the reason, which
`make test` and CI count as a failure):
`steadyserve validate` through the balancer sees one vector per fingerprint across both
replicas; load spreads over the replicas; SIGTERM to one replica under load finishes its
streams, the balancer sends it nothing new, no client sees a refusal or a truncated stream, and
the gRPC client given both replicas' addresses keeps serving. The drain test uses up a replica, so it
has a cluster of its own: the tests pass in any order.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("cluster_demo", ROOT / "scripts" / "cluster_demo.py")
cluster_demo = importlib.util.module_from_spec(_spec)
assert _spec.loader is not None
_spec.loader.exec_module(cluster_demo)

STEADYSERVE = [sys.executable, "-m", "steadyserve.cli"]


def admitted(replica) -> float:
    return sum(v for (name, _), v in replica.metrics().items() if name == "steadyserve_requests_admitted_total")


def run_tool(*args: str, timeout: float = 150) -> dict:
    r = subprocess.run([*STEADYSERVE, *args, "--json"], capture_output=True, text=True, timeout=timeout)
    try:
        return {"rc": r.returncode, **json.loads(r.stdout)}
    except json.JSONDecodeError:
        raise AssertionError(f"rc={r.returncode}\nstdout:{r.stdout[-2000:]}\nstderr:{r.stderr[-2000:]}") from None


def test_nginx_config_template() -> None:
    """The rendered config has what SSE, keep-alive, failover and gRPC need (no nginx needed)."""
    text = cluster_demo.render_config("/tmp/x", ["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3", "127.0.0.1:4"],
                                      8080, 8081)
    http = text[text.index("upstream steadyserve_http"):]
    assert "server 127.0.0.1:1 max_fails" in http and "server 127.0.0.1:2 max_fails" in http
    for needle in ("proxy_buffering off;", "proxy_http_version 1.1;", "keepalive 64;",
                   "proxy_next_upstream error timeout http_503 http_429 non_idempotent;",
                   "proxy_next_upstream_tries 2;", "listen 127.0.0.1:8081 http2;",
                   "grpc_pass grpc://steadyserve_grpc;", "proxy_set_header Connection $connection_upgrade;"):
        assert needle in text, needle
    assert "proxy_request_buffering off" not in text  # nginx must keep the body to resend it to another replica
    assert "{{" not in text


def _nginx() -> str:
    try:
        return cluster_demo.find_nginx(install=True)
    except cluster_demo.NginxUnavailable as e:  # an error under `make test` / CI (tests/conftest.py)
        pytest.skip(f"nginx unavailable: {e}")


@pytest.fixture(scope="module")
def cluster(tiny_model: str):
    with cluster_demo.Cluster(tiny_model, 2, ("--stall-timeout", "10", "--drain-timeout", "60"), threads=1,
                              nginx_binary=_nginx()) as c:
        yield c


@pytest.fixture
def own_cluster(tiny_model: str):
    """For the test that stops a replica: its own cluster, so the module's stays whole in any test order."""
    with cluster_demo.Cluster(tiny_model, 2, ("--stall-timeout", "10", "--drain-timeout", "60"), threads=1,
                              nginx_binary=_nginx()) as c:
        yield c


def test_validate_through_the_balancer(cluster) -> None:
    """One distinct vector per probe kind, over both replicas, through nginx (HTTP and gRPC)."""
    before = [admitted(r) for r in cluster.replicas]
    rep = run_tool("validate", "--http", cluster.http_url, "--grpc", cluster.grpc_addr, "-n", "32", "-c", "16",
                   "--background", "0.5")
    assert rep["rc"] == 0 and rep["passed"], json.dumps(rep, indent=1)[:3000]
    assert rep["errors"] == 0
    for kind, k in rep["kinds"].items():
        assert len(k["fingerprints"]) == 1, kind  # same weights, dtype, device, invariance on both replicas
        (fp,) = k["fingerprints"].values()
        assert fp["distinct_vectors"] == 1, (kind, fp)
        assert set(fp["by_transport"]) >= {"http", "grpc"}, fp
    served = [admitted(r) - b for r, b in zip(cluster.replicas, before)]
    print(f"validate through nginx: kinds={sorted(rep['kinds'])} requests per replica={served}")
    assert all(s > 0 for s in served), f"the probes did not reach both replicas: {served}"


def test_load_spreads_over_replicas(cluster) -> None:
    before = [admitted(r) for r in cluster.replicas]
    rep = run_tool("bench", "--url", cluster.http_url, "--transport", "sse", "-c", "8", "-n", "40",
                   "--output-tokens", "8-16", "--prompt-words", "4-16")
    assert rep["rc"] == 0 and rep["truncated_streams"] == 0, rep
    assert rep["status"] == {"200": 40}, rep["status"]
    served = [admitted(r) - b for r, b in zip(cluster.replicas, before)]
    print(f"bench through nginx: requests per replica={served}")
    assert sum(served) == 40
    assert min(served) >= 40 * 0.25, f"load not spread: {served}"
    # gRPC through nginx is balanced per call, not per connection.
    before = [admitted(r) for r in cluster.replicas]
    rep = run_tool("bench", "--grpc", cluster.grpc_addr, "--transport", "grpc", "-c", "4", "-n", "20",
                   "--output-tokens", "8", "--prompt-words", "4")
    assert rep["rc"] == 0 and rep["truncated_streams"] == 0, rep
    served = [admitted(r) - b for r, b in zip(cluster.replicas, before)]
    print(f"gRPC bench through nginx (one client connection): requests per replica={served}")
    assert min(served) >= 20 * 0.25, f"gRPC not spread per call: {served}"


def _grpc_worker(addrs: list[str], stop: threading.Event, results: list, errors: list) -> None:
    from steadyserve.client import Client

    with Client(addrs) as c:
        while not stop.is_set():
            try:
                final = None
                for msg in c.generate("the quick brown fox", max_tokens=24, temperature=0, ignore_eos=True,
                                      timeout=60):
                    if msg.WhichOneof("event") == "final":
                        final = msg.final
                results.append(final.finish_reason if final is not None else None)
            except Exception as e:  # noqa: BLE001 - any error is a failure of the test
                errors.append(repr(e))


@pytest.mark.slow
def test_drain_one_replica_under_load(own_cluster) -> None:
    """SIGTERM to replica 0 during HTTP (via nginx) and gRPC (client-side, both addresses) load."""
    cluster = own_cluster
    victim, survivor = cluster.replicas
    stop = threading.Event()
    grpc_results: list = []
    grpc_errors: list = []
    workers = [threading.Thread(target=_grpc_worker, args=([victim.grpc_addr, survivor.grpc_addr], stop,
                                                             grpc_results, grpc_errors), daemon=True)
               for _ in range(2)]
    for w in workers:
        w.start()
    bench = subprocess.Popen([*STEADYSERVE, "bench", "--url", cluster.http_url, "--transport", "sse", "-c", "8",
                              "-n", "64", "--output-tokens", "48-96", "--prompt-words", "8-32", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Signal while the victim has HTTP streams (through nginx) running, so that nginx keeps
        # sending it requests during its drain: those are refused (503) and must be retried.
        deadline = time.monotonic() + 60
        http0 = victim.metric("steadyserve_requests_admitted_total", transport="http")
        while (victim.metric("steadyserve_requests_admitted_total", transport="http") - http0 < 2
               or victim.metric("steadyserve_requests_running") < 2):
            assert bench.poll() is None, "bench ended before the victim had work"
            assert time.monotonic() < deadline, "the victim never got work"
            time.sleep(0.05)
        grpc_before = len(grpc_results)
        victim.signal(signal.SIGTERM)
        t_signal = time.monotonic()
        # From the first scrape after the signal, the victim admits nothing new.
        samples, grpc_started = [], []
        gen = dict(grpc_type="server_stream", grpc_service="steadyserve.v1.Inference", grpc_method="Generate")
        while victim.proc.poll() is None:
            try:
                samples.append(admitted(victim))
                grpc_started.append(victim.metric("grpc_server_started_total", **gen))
            except OSError:
                break
            time.sleep(0.05)
        code = victim.wait(90)
        drain_s = time.monotonic() - t_signal
        out, err = bench.communicate(timeout=240)
    finally:
        stop.set()
        for w in workers:
            w.join(90)
        if bench.poll() is None:
            bench.kill()
    assert code == 0, victim.logs()[-3000:]
    assert samples and max(samples) == samples[0], f"victim admitted work after SIGTERM: {samples[0]} -> {max(samples)}"
    rep = json.loads(out)
    print(f"drain under load: victim exited 0 after {drain_s:.1f} s; bench status={rep['status']} "
          f"truncated={rep['truncated_streams']} errors={rep['error_codes']}; "
          f"gRPC calls={len(grpc_results)} ({len(grpc_results) - grpc_before} after SIGTERM) errors={len(grpc_errors)}; "
          f"gRPC calls the victim saw start after SIGTERM: {grpc_started[-1] - grpc_started[0] if grpc_started else '?'}")
    assert rep["truncated_streams"] == 0, rep
    assert rep["status"] == {"200": 64}, rep["status"]  # no client saw a 503 from the draining replica
    assert not rep["error_codes"], rep["error_codes"]
    assert set(rep["finish_reasons"]) <= {"length", "stop"}, rep["finish_reasons"]
    # The victim's streams ended normally: its log shows a clean drain, not a cut.
    logs = victim.logs()
    assert "drain timeout" not in logs and "drained" in logs
    # nginx retried the victim's refusals (503) or its closed port on the survivor.
    retried = [m.group(1) for l in cluster.nginx.access_log()
               if (m := re.search(r"upstream_status=(\d{3}(?:, \d{3})+)", l))]
    print(f"nginx: {len(retried)} requests retried on the other replica: {sorted(set(retried))}")
    # gRPC, client-side balancing over both addresses: kept serving through the drain.
    assert not grpc_errors, grpc_errors[:3]
    assert len(grpc_results) - grpc_before >= 4, "the gRPC client did not keep serving after the drain began"
    assert all(r for r in grpc_results), "a gRPC stream ended without a final message"
    # The survivor still serves through nginx.
    rep = run_tool("bench", "--url", cluster.http_url, "--transport", "sse", "-c", "4", "-n", "8",
                   "--output-tokens", "8")
    assert rep["status"] == {"200": 8} and rep["truncated_streams"] == 0
