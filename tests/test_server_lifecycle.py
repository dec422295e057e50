"""Server.shutdown (api/server.py): every step runs, each failure is logged and counted, never swallowed,
and shutdown still ends within its bounds. No model: the engine, gRPC and HTTP are stand-ins."""

from __future__ import annotations

import asyncio
import logging
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
