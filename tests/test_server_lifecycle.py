"""Server.shutdown (api/server.py): every step runs, each failure is logged and counted, never swallowed,
and shutdown still ends within its bounds. No model: the engine, gRPC and HTTP are stand-ins. And the process
that returns from it ends with its exit code, its exit handlers and output, without the interpreter's teardown."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from steadyserve.api.server import EXIT_OK, Server
from steadyserve.config import Config


class Engine:
    def __init__(self, fail: bool) -> None:
        self.fail, self.stopped, self.num_in_flight = fail, False, 0

    def shutdown(self) -> None:
        self.stopped = True
        if self.fail:
            raise RuntimeError("engine thread would not join")


class Grpc:
    def __init__(self, fail: bool) -> None:
        self.fail, self.stopped = fail, False

    async def stop(self, grace: float) -> None:
        self.stopped = True
        if self.fail:
            raise OSError("grpc server already closed")


def server(fail: bool, http_hangs: bool) -> tuple[Server, Engine, Grpc]:
    srv = Server(Config())
    engine, grpc = Engine(fail), Grpc(fail)
    srv.state = SimpleNamespace(engine=engine, streams=SimpleNamespace(open=[]))  # type: ignore[assignment]
    srv.grpc = grpc
    srv._http = SimpleNamespace(should_exit=False)  # type: ignore[assignment]
    srv.step_timeout_s = 0.3
    return srv, engine, grpc


async def run_shutdown(fail: bool, http_hangs: bool) -> tuple[Server, Engine, Grpc, float]:
    srv, engine, grpc = server(fail, http_hangs)
    srv._http_task = asyncio.create_task(asyncio.sleep(60 if http_hangs else 0))
    srv._stop.set()  # as after SIGTERM: the drain runs first (nothing in flight)
    t0 = time.monotonic()
    await srv.shutdown()
    return srv, engine, grpc, time.monotonic() - t0


def test_a_clean_shutdown_stops_everything_and_reports_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "steadyserve.server")
    srv, engine, grpc, _ = asyncio.run(run_shutdown(fail=False, http_hangs=False))
    assert engine.stopped and grpc.stopped and srv._http.should_exit  # type: ignore[union-attr]
    assert srv.shutdown_failures == [] and srv.exit_code == EXIT_OK
    assert "shutdown step failed" not in caplog.text and "drained" in caplog.text


def test_every_failing_step_is_logged_and_counted_and_shutdown_still_ends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "steadyserve.server")
    srv, engine, grpc, took = asyncio.run(run_shutdown(fail=True, http_hangs=True))
    assert srv.shutdown_failures == ["grpc", "http", "engine"]  # a failure does not skip the later steps
    assert engine.stopped and grpc.stopped
    failed = [r for r in caplog.records if r.getMessage() == "shutdown step failed"]
    assert [r.fields["step"] for r in failed] == ["grpc", "http", "engine"]  # type: ignore[attr-defined]
    assert "OSError: grpc server already closed" in failed[0].fields["error"]  # type: ignore[attr-defined]
    assert "TimeoutError" in failed[1].fields["error"]  # type: ignore[attr-defined]
    stopped = [r for r in caplog.records if r.getMessage() == "stopped"]
    assert stopped[-1].fields["shutdown_failures"] == ["grpc", "http", "engine"]  # type: ignore[attr-defined]
    assert took < 0.3 + 2.0  # the hung HTTP server costs its step's bound, not its 60 s


def test_a_start_up_failure_is_logged_and_what_started_is_stopped(caplog: pytest.LogCaptureFixture) -> None:
    class Unstartable(Engine):
        death_observers: list = []

        def start(self) -> None:
            raise RuntimeError("no model thread")

    srv = Server(Config())
    engine = Unstartable(fail=False)
    srv.state = SimpleNamespace(engine=engine)  # type: ignore[assignment]
    caplog.set_level(logging.INFO, "steadyserve.server")
    with pytest.raises(RuntimeError, match="no model thread"):
        asyncio.run(srv.serve())
    assert engine.stopped and "start-up failed" in caplog.text and srv.shutdown_failures == []


EXIT_SCRIPT = r"""
import atexit, sys, threading, time
from pathlib import Path
from steadyserve.process_exit import exit_process

out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
if sys.argv[2] == "thread":  # a non-daemon thread still working: the exit must wait for it
    threading.Thread(target=lambda: (time.sleep(0.3), (out / "thread").write_text("done"))).start()
sys.stdout.write("unflushed, no newline")
exit_process(3)
"""


@pytest.mark.parametrize("thread", ["none", "thread"])
def test_a_process_entry_exits_with_its_code_after_exit_handlers_flushed_output_and_working_threads(tmp_path,
                                                                                                   thread):
    """process_exit.exit_process (the end of `python -m steadyserve ...`) skips only the interpreter's teardown."""
    r = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path), thread], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "unflushed, no newline"
    assert (tmp_path / "atexit").read_text() == "ran"
    if thread == "thread":
        assert (tmp_path / "thread").read_text() == "done"
