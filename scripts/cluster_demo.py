#!/usr/bin/env python3
"""N steadyserve replicas on 127.0.0.1 behind nginx (HTTP + gRPC), for `make cluster-demo` and the tests.

    python scripts/cluster_demo.py [--replicas 2] [--model PATH] [-- serve flags...]

Each replica is a real `steadyserve serve` on ephemeral ports (steadyserve.testing.server);
nginx (Debian's package; installed with apt-get when missing and running as root) runs from
a temporary prefix with a config rendered from deploy/nginx/nginx.conf.template. Prints the
URLs and waits for Ctrl-C / SIGTERM, then drains the replicas and stops nginx.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from steadyserve.testing.server import ServerProcess  # noqa: E402

TEMPLATE = ROOT / "deploy" / "nginx" / "nginx.conf.template"


class NginxUnavailable(RuntimeError):
    """nginx is not installed and cannot be installed here."""


def find_nginx(install: bool = True) -> str:
    """The nginx binary; installs Debian's package when missing and we are root (as CI is)."""
    for cand in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if cand and os.access(cand, os.X_OK):
            return cand
    if not install:
        raise NginxUnavailable("nginx is not installed")
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise NginxUnavailable("nginx is not installed and cannot be installed here "
                               "(needs root and apt-get: apt-get install nginx)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nginx"]):
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise NginxUnavailable(f"{' '.join(argv)} failed: {r.stderr.strip()[-500:]}")
    for cand in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise NginxUnavailable("apt-get install nginx succeeded but no nginx binary was found")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def render_config(prefix: str, http_backends: list[str], grpc_backends: list[str], http_port: int,
                  grpc_port: int, listen_host: str = "127.0.0.1") -> str:
    def servers(addrs: list[str]) -> str:
        return "\n".join(f"        server {a} max_fails=2 fail_timeout=5s;" for a in addrs)

    text = TEMPLATE.read_text()
    for key, value in {"prefix": prefix, "http_servers": servers(http_backends),
                       "grpc_servers": servers(grpc_backends), "http_port": str(http_port),
                       "grpc_port": str(grpc_port), "listen_host": listen_host,
                       "replicas": str(max(len(http_backends), 1))}.items():
        text = text.replace("{{" + key + "}}", value)
    assert "{{" not in text, "unfilled field in the nginx template"
    return text


class Nginx:
    """nginx from a private prefix on ephemeral 127.0.0.1 ports."""

    def __init__(self, http_backends: list[str], grpc_backends: list[str], binary: str | None = None) -> None:
        self.binary = binary or find_nginx()
        self.prefix = tempfile.mkdtemp(prefix="steadyserve-nginx-")
        os.chmod(self.prefix, 0o755)  # workers run as an unprivileged user when nginx starts as root
        for d in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            os.makedirs(os.path.join(self.prefix, "tmp", d), mode=0o777, exist_ok=True)
            os.chmod(os.path.join(self.prefix, "tmp", d), 0o777)
        self.http_port, self.grpc_port = free_port(), free_port()
        self.conf = os.path.join(self.prefix, "nginx.conf")
        Path(self.conf).write_text(render_config(self.prefix, http_backends, grpc_backends, self.http_port,
                                                 self.grpc_port))
        test = subprocess.run([self.binary, "-t", "-p", self.prefix, "-c", self.conf], capture_output=True,
                              text=True, timeout=30)
        if test.returncode != 0:
            raise RuntimeError(f"nginx -t failed:\n{test.stderr}")
        self.log = open(os.path.join(self.prefix, "stderr.log"), "wb")
        self.proc = subprocess.Popen([self.binary, "-p", self.prefix, "-c", self.conf], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}: {self.error_log()}")
            try:
                with urllib.request.urlopen(self.http_url + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nginx did not answer within 20 s: {self.error_log()}")
            time.sleep(0.1)

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def error_log(self) -> str:
        p = Path(self.prefix) / "error.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def access_log(self) -> list[str]:
        p = Path(self.prefix) / "access.log"
        return p.read_text(errors="replace").splitlines() if p.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish open requests
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.prefix, ignore_errors=True)


class Cluster:
    """N replicas (started in parallel) and nginx in front of them."""

    def __init__(self, model: str, replicas: int = 2, serve_args: tuple[str, ...] = (), threads: int = 1,
                 nginx_binary: str | None = None) -> None:
        binary = nginx_binary or find_nginx()  # fail before loading any model
        self.replicas: list[ServerProcess] = []
        with ThreadPoolExecutor(replicas) as pool:
            futures = [pool.submit(ServerProcess, model, *serve_args, threads=threads) for _ in range(replicas)]
            errors = []
            for f in futures:
                try:
                    self.replicas.append(f.result())
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
        if errors:
            self.stop()
            raise errors[0]
        try:
            self.nginx = Nginx([f"127.0.0.1:{r.http_port}" for r in self.replicas],
                               [r.grpc_addr for r in self.replicas], binary)
        except Exception:
            self.stop()
            raise

    @property
    def http_url(self) -> str:
        return self.nginx.http_url

    @property
    def grpc_addr(self) -> str:
        return self.nginx.grpc_addr

    def stop(self) -> None:
        for r in self.replicas:
            if r.proc.poll() is None:
                r.signal(signal.SIGTERM)
        for r in self.replicas:
            try:
                r.wait(60)
            except subprocess.TimeoutExpired:
                r.kill()
            r.__exit__(None, None, None)  # closes its log, removes its temporary directory
        if getattr(self, "nginx", None) is not None:
            self.nginx.stop()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", default="", help="as steadyserve serve --model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica (default: %(default)s)")
    a, serve_args = p.parse_known_args(argv)
    serve_args = [x for x in serve_args if x != "--"]
    try:
        find_nginx()
    except NginxUnavailable as e:
        print(f"cluster-demo: {e}", file=sys.stderr)
        return 2
    print(f"starting {a.replicas} replicas (model: {a.model or 'SmolLM2-135M-Instruct'}) ...", flush=True)
    cluster = Cluster(a.model, a.replicas, tuple(serve_args), threads=a.threads)
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        print("\nsteadyserve cluster is up")
        print(f"  HTTP (nginx)   {cluster.http_url}        e.g. {cluster.http_url}/v1/completions")
        print(f"  gRPC (nginx)   {cluster.grpc_addr}")
        for i, r in enumerate(cluster.replicas):
            print(f"  replica {i}      {r.http_url}  grpc {r.grpc_addr}  pid {r.pid}  metrics {r.http_url}/metrics")
        grpc_all = ",".join(r.grpc_addr for r in cluster.replicas)
        print(f"  client-side    steadyserve.client.Client({grpc_all.split(',')!r})")
        print(f"\n  steadyserve validate --http {cluster.http_url} --grpc {cluster.grpc_addr} -n 64 -c 16")
        print(f"  steadyserve bench --url {cluster.http_url} --transport sse -c 16 -n 64")
        print(f"  nginx logs     {cluster.nginx.prefix}/access.log")
        print("\nCtrl-C drains the replicas and stops.", flush=True)
        while not stop and all(r.proc.poll() is None for r in cluster.replicas):
            time.sleep(0.5)
    finally:
        print("stopping: draining replicas ...", flush=True)
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
