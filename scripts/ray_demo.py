#!/usr/bin/env python3
"""A local Ray cluster on 127.0.0.1 serving steadyserve on Ray Serve, for `make ray-demo` and the tests.

    python scripts/ray_demo.py [--replicas 2] [--model PATH] [-- serve flags...]

Starts a Ray head (`ray start --head`, dashboard on loopback), deploys deploy/ray/serve.yaml as
`serve deploy` does (its ports, replica count and serve flags replaced by the arguments), waits until
the application runs, prints the URLs and waits for Ctrl-C / SIGTERM; then `serve shutdown`
(replicas drain) and `ray stop`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "deploy" / "ray" / "serve.yaml"
BIN = Path(sys.executable).parent  # ray and serve come with the venv's `steadyserve[ray]`
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}


_HANDED_OUT: set[int] = set()  # ports free_port gave this process: never twice


def free_port() -> int:
    """A free port below the kernel's ephemeral range, for a Ray process that binds it later.

    A port that bind(0) handed out and took back can be handed to any process that binds port 0 before Ray binds
    it: a test server on the other pytest worker, or one of Ray's own processes. It happened (one `make test`
    run in three on an AMD EPYC): the deploy's PUT reached a gRPC server instead of the dashboard and failed with
    BadStatusLine. Below the ephemeral range (ip_local_port_range) only an explicit bind takes a port, and Ray's
    worker ports (10002-19999 by default) stay below 20000."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    for _ in range(200):
        port = random.randrange(20000, low) if low > 20100 else 0  # no room below the range: the kernel's choice
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range after 200 tries")


def render_config(http_port: int, grpc_port: int, serve_args: list[str], replicas: int | None,
                  deployment_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """deploy/ray/serve.yaml with the demo's ports, flags and replica count (fixed, or its autoscaling)."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["http_options"]["port"] = http_port
    cfg["grpc_options"]["port"] = grpc_port
    app_args = cfg["applications"][0]["args"]
    app_args["serve_args"] = serve_args
    dc = app_args.setdefault("deployment_config", {})
    if replicas is not None:
        dc.pop("autoscaling_config", None)
        dc["num_replicas"] = replicas
    dc.update(deployment_config or {})
    return cfg


class RayCluster:
    """A Ray head on 127.0.0.1 in a temporary directory, and steadyserve deployed on it."""

    def __init__(self, num_cpus: int = 4) -> None:
        # Ray's socket paths must stay short: a /tmp directory of its own.
        self.dir = tempfile.mkdtemp(prefix="ssray-", dir="/tmp")
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.http_port, self.grpc_port = free_port(), free_port()
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        cmd = [str(BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.gcs_port),
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
               "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
               "--metrics-export-port", str(free_port()), "--num-cpus", str(num_cpus),
               "--object-store-memory", str(256 * 1024**2), "--temp-dir", self.dir, "--disable-usage-stats"]
        r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=180)
        if r.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        self.address = f"127.0.0.1:{self.gcs_port}"

    def deploy(self, config: dict[str, Any], timeout: float = 300.0) -> None:
        """Deploy the config as `serve deploy` does (PUT to the dashboard's Serve API), then wait until its
        application is RUNNING. The config is also written to the cluster's directory, for `serve deploy`."""
        (Path(self.dir) / "serve.yaml").write_text(yaml.safe_dump(config))
        deadline = time.monotonic() + timeout
        request = urllib.request.Request(f"{self.dashboard}/api/serve/applications/", method="PUT",
                                         data=json.dumps(config).encode(),
                                         headers={"Content-Type": "application/json"})
        while True:  # the dashboard's Serve API comes up a little after `ray start` returns
            try:
                with urllib.request.urlopen(request, timeout=60):
                    break
            except OSError as e:
                if time.monotonic() > deadline:
                    body = e.read().decode(errors="replace") if hasattr(e, "read") else ""
                    raise RuntimeError(f"deploying to {self.dashboard} failed: {e} {body[-3000:]}") from None
                time.sleep(1)
        self.wait_running(config["applications"][0]["name"], deadline)

    def applications(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.dashboard}/api/serve/applications/", timeout=30) as r:
            return json.load(r)["applications"]

    def wait_running(self, name: str, deadline: float) -> None:
        status = "?"
        while time.monotonic() < deadline:
            try:
                app = self.applications().get(name, {})
            except OSError:
                app = {}
            status = app.get("status", "?")
            if status == "RUNNING":
                return
            if status == "DEPLOY_FAILED":
                raise RuntimeError(f"deploy failed: {app.get('message')}")
            time.sleep(1)
        raise RuntimeError(f"application {name} not RUNNING (status {status}); logs in {self.dir}/session_latest/logs")

    def replica_pids(self, app: str = "steadyserve", deployment: str = "EngineReplica") -> list[int]:
        """The worker processes of the deployment's RUNNING replicas, as Serve's controller reports them."""
        try:
            replicas = self.applications()[app]["deployments"][deployment]["replicas"]
        except (OSError, KeyError):
            return []
        return sorted(r["pid"] for r in replicas if r.get("state") == "RUNNING")

    def stop(self, drain_timeout: float = 120.0) -> None:
        """Delete the applications as `serve shutdown` does (replicas drain their streams first), then
        `ray stop`; removes the temporary directory."""
        if getattr(self, "address", None):
            request = urllib.request.Request(f"{self.dashboard}/api/serve/applications/", method="DELETE")
            try:
                urllib.request.urlopen(request, timeout=60).close()
                deadline = time.monotonic() + drain_timeout
                while self.applications() and time.monotonic() < deadline:
                    time.sleep(0.5)
            except OSError:
                pass  # the cluster is already gone or broken: ray stop below ends what is left
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=ENV, capture_output=True, timeout=120)
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default: %(default)s)")
    p.add_argument("--model", default="", help="model path (default: the default model)")
    p.add_argument("serve_args", nargs="*", help="more `steadyserve serve` flags, after --")
    a = p.parse_args(argv)
    serve_args = (["--model", a.model] if a.model else []) + ["--threads", "1", *a.serve_args]
    cluster = RayCluster()
    try:
        cluster.deploy(render_config(cluster.http_port, cluster.grpc_port, serve_args, a.replicas))
        print(f"steadyserve on Ray Serve, {a.replicas} replicas:\n"
              f"  HTTP (OpenAI API, SSE, WebSocket)  http://127.0.0.1:{cluster.http_port}/v1\n"
              f"  gRPC (steadyserve.v1.Inference)    127.0.0.1:{cluster.grpc_port}\n"
              f"  Ray dashboard                      {cluster.dashboard}\n"
              f"  try: steadyserve validate --http http://127.0.0.1:{cluster.http_port} "
              f"--grpc 127.0.0.1:{cluster.grpc_port}\n"
              "Ctrl-C stops the cluster (the replicas drain first).", flush=True)
        stop = {"flag": False}
        signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
        try:
            while not stop["flag"]:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
