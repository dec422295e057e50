"""The `steadyserve serve` process a Ray Serve replica owns: started, watched, drained.

A replica does not embed the engine in Ray's worker process: it starts the very server `steadyserve
serve` runs, as a child on 127.0.0.1 with ephemeral ports, and forwards requests to it over loopback.
So a replica behind Ray behaves exactly as a server on its own (same flags, same process-level
numerics switch, same stall, drain and engine-death handling), and Ray's worker, which runs Ray's
own threads and event loop, never runs model code.

The child dies with its parent: PR_SET_PDEATHSIG sends it SIGTERM if the replica's worker dies
(`ray.kill`, an OOM kill), so a killed replica never leaves an orphaned engine holding memory.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..ready_file import read_ready_file

# Flags the replica sets itself: the child listens on loopback, on ports it picks, and says which.
OWNED_FLAGS = ("--host", "--http-port", "--grpc-port", "--ready-file")
_PR_SET_PDEATHSIG = 1


def refuse_owned_flags(serve_args: list[str]) -> None:
    """ValueError if `serve_args` sets a flag that each replica sets itself."""
    owned = [a for a in serve_args if a.split("=", 1)[0] in OWNED_FLAGS]
    if owned:
        raise ValueError(f"serve_args: {', '.join(owned)} is set by each replica (loopback, ephemeral ports)")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass(frozen=True)
class ChildAddress:
    """Where a started child listens."""

    http_url: str  # http://127.0.0.1:PORT
    grpc_target: str  # 127.0.0.1:PORT
    pid: int  # the server's process id (after its own re-exec for --numerics, if any)


class ChildServer:
    """One `steadyserve serve` child process. `start()` blocks until it serves or has failed."""

    def __init__(self, serve_args: list[str], startup_timeout: float = 600.0) -> None:
        refuse_owned_flags(serve_args)
        self.serve_args = list(serve_args)  # `steadyserve serve` flags, as on the command line
        self.startup_timeout = startup_timeout
        self._dir = tempfile.mkdtemp(prefix="steadyserve-replica-")
        self.ready_file = Path(self._dir) / "ready.json"
        self.log_path = Path(self._dir) / "server.log"
        self.proc: subprocess.Popen | None = None
        self.address: ChildAddress | None = None

    def start(self) -> ChildAddress:
        argv = [sys.executable, "-m", "steadyserve", "serve", *self.serve_args, "--host", "127.0.0.1",
                "--http-port", "0", "--grpc-port", "0", "--ready-file", str(self.ready_file)]
        with open(self.log_path, "ab") as log:
            # The child's log goes to a file and to the replica's stderr (Ray's replica log) once it fails.
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            info = read_ready_file(self.ready_file)
            if info is not None:
                break
            if self.proc.poll() is not None:
                raise RuntimeError(f"steadyserve serve exited with {self.proc.returncode} while starting:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"steadyserve serve not serving after {self.startup_timeout:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)
        self.address = ChildAddress(f"http://127.0.0.1:{info['http_port']}", f"127.0.0.1:{info['grpc_port']}",
                                    int(info["pid"]))
        return self.address

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode("utf-8", "replace")
        except OSError:
            return ""

    def drain(self, timeout: float) -> int | None:
        """SIGTERM (the server drains its in-flight streams, then exits 0); SIGKILL after `timeout`.
        Returns the exit code, None if there was no process."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def cleanup(self) -> None:
        for p in (self.ready_file, self.log_path):
            p.unlink(missing_ok=True)
        try:
            os.rmdir(self._dir)
        except OSError:
            pass
