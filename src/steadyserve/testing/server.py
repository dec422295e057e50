"""Start a real `steadyserve serve` process on 127.0.0.1 with ephemeral ports.

Used by the tests, the benchmarks and `make cluster-demo`. The process is the
real server (real sockets, real engine); the caller gets its URLs and can
signal it, read its logs and its metrics.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..ready_file import read_ready_file
from .cgroups import JOIN_AND_EXEC


# STEADYSERVE_TEST_SERVER_LOG=FILE: one line per server started (the test that started it, seconds to ready, its
# flags), appended to FILE: where a suite's server start-ups go (each costs seconds of CPU on a small CI machine).
SERVER_LOG_ENV = "STEADYSERVE_TEST_SERVER_LOG"


def _log_start(argv: list[str], ready_s: float) -> None:
    path = os.environ.get(SERVER_LOG_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    flags = " ".join(a for a in argv[argv.index("--model") + 2:] if not a.startswith("/"))
    with open(path, "a") as f:  # one short write per line: lines from parallel workers do not interleave
        f.write(f"{test}\t{ready_s:.2f}\t{flags}\n")


class ServerProcess:
    def __init__(self, model: str, *args: str, env: dict[str, str] | None = None, startup_timeout: float = 180.0,
                 threads: int = 2, test_faults: bool = False, test_drift: bool = False,
                 test_memory_root: str = "", cgroup: str = "", test_log_prompts: bool = False,
                 test_log_aborts: bool = False) -> None:
        """`test_faults` / `test_drift` / `test_memory_root` / `test_log_prompts` / `test_log_aborts`: start through
        steadyserve.testing.serve with those TEST-ONLY hooks (test_memory_root reads the memory limit from a
        fixture tree; see steadyserve/memory.py).
        `threads` 0 passes `--threads 0`: the server picks its CPU budget. `cgroup`: a cgroup directory the
        server's process joins (its cgroup.procs) before it execs the server, e.g. testing/cgroups.py's."""
        self._dir = tempfile.mkdtemp(prefix="steadyserve-test-")
        self.ready_file = Path(self._dir) / "ready.json"
        self.log_path = Path(self._dir) / "server.log"
        hooks = ["--test-faults"] * test_faults + ["--test-drift"] * test_drift
        hooks += ["--test-log-prompts"] * test_log_prompts + ["--test-log-aborts"] * test_log_aborts
        hooks += ["--test-memory-root", test_memory_root] if test_memory_root else []
        entry = ["steadyserve.testing.serve", *hooks] if hooks else ["steadyserve.cli", "serve"]
        argv = [sys.executable, "-m", *entry, "--model", model, "--http-port", "0",
                "--grpc-port", "0", "--ready-file", str(self.ready_file), "--threads", str(threads), *args]
        if cgroup:  # a shell moves itself into the cgroup, then becomes the server: the same pid
            argv = ["sh", "-c", JOIN_AND_EXEC, cgroup, *argv]
        self.argv = argv
        self._log = open(self.log_path, "wb")
        self._final_logs: str | None = None
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        try:
            deadline = time.monotonic() + startup_timeout
            while not read_ready_file(self.ready_file):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready after {startup_timeout} s:\n{self.logs()}")
                time.sleep(0.05)
        except BaseException:  # no process, log file or temporary directory outlives a failed start
            self.kill()
            self._cleanup()
            raise
        info = read_ready_file(self.ready_file)
        _log_start(self.argv, time.monotonic() - (deadline - startup_timeout))
        self.http_port: int = info["http_port"]
        self.grpc_port: int = info["grpc_port"]
        self.pid: int = info["pid"]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def logs(self) -> str:
        if self._final_logs is not None:  # stopped and cleaned up: what the log held at the end
            return self._final_logs
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics_text(self, headers: dict[str, str] | None = None) -> str:
        req = urllib.request.Request(self.http_url + "/metrics", headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Samples as {(name, sorted labels): value}, parsed by prometheus-client's own parser."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(self.metrics_text()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def prompt_ids(self, request_id: str) -> list[int]:
        """The prompt token ids the engine got for the request whose id is or starts with request_id (a server
        started with test_log_prompts; testing/prompt_log.py)."""
        from .prompt_log import logged_prompts

        found = [ids for rid, ids in logged_prompts(self.logs()).items() if rid.startswith(request_id)]
        assert len(found) == 1, f"{len(found)} logged prompts for request id {request_id!r}"
        return found[0]

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def _cleanup(self) -> None:
        if self._final_logs is None:
            self._final_logs = self.logs()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self._cleanup()


def start_servers(*specs: tuple[tuple, dict]) -> list[ServerProcess]:
    """Start several servers side by side: `specs` are (args, kwargs) for ServerProcess.

    All or nothing: if one fails to start, the ones that did start are stopped before the error is raised,
    so a failed fixture leaves no server behind."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(ServerProcess, *args, **kwargs) for args, kwargs in specs]
    started, errors = [], []
    for f in futures:
        try:
            started.append(f.result())
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    if errors:
        for s in started:
            s.__exit__(None, None, None)
        raise errors[0]
    return started
