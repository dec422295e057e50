"""The server process: load, then uvicorn's serve = startup(), main_loop(), shutdown().

load(): load the model, size the KV cache, run the batch-invariance
self-test. startup(): start the engine thread, bind HTTP (uvicorn) and gRPC on
one event loop, over one engine. main_loop(): wait for a signal or engine
death (SIGHUP only reloads the keys file of --api-keys). shutdown(): drain, stop gRPC, HTTP and the engine.
On SIGTERM: go unready at once, refuse new work with 503 / UNAVAILABLE, let in-flight streams finish for up to
--drain-timeout, then exit 0. A second signal exits at once. If the engine
loop dies, health goes NOT_SERVING, open streams get error events, and the
process exits non-zero within seconds.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
import socket
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import uvicorn

from ..config import Config, ConfigError
from ..limits import HTTP_KEEP_ALIVE_S
from ..metrics import sample_loop_lag
from ..ready_file import write_ready_file
from .console import mount_console
from .http.app import create_app
from .http.edge import EdgeLimits, edge_protocol
from .http.envelope import Envelope
from .startup import EngineHooks, build_state
from .otel import traces_endpoint
from .state import ServerState

log = logging.getLogger("steadyserve.server")

EXIT_OK, EXIT_ENGINE_DEAD, EXIT_SELFTEST_FAILED, EXIT_FORCED = 0, 3, 4, 1
# How long stopping gRPC, and then HTTP, may take (the drain has --drain-timeout, the engine's join its own
# 10 s). HTTP's graceful shutdown takes 3 s; past this bound the step is logged as failed and shutdown goes on.
SHUTDOWN_STEP_TIMEOUT_S = 10.0
KEYS_POLL_S = 2.0  # how often the keys file (--api-keys) is checked for a change


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the Server drains first, then tells it to exit."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


# Kernel send buffer of each HTTP connection (accepted sockets inherit it from the listener; Linux
# doubles it). Left to autotuning it grows to tcp_wmem's max (4 MiB): a client that stops reading
# would then hide megabytes before a write blocks, so --stall-timeout could not see the stall for
# a whole long stream, and each stalled stream would pin that much kernel memory.
SEND_BUFFER_BYTES = 128 * 1024


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class Server:
    """uvicorn's shape: serve() = startup(), main_loop(), shutdown(), each an explicit method.

    load() (the model, the KV cache, the self-test) runs before the event loop exists, so that a load error
    is reported as a usage error before anything binds."""

    def __init__(self, config: Config, hooks: EngineHooks | None = None) -> None:
        self.config = config
        self.hooks = hooks  # start-up hooks on the engine: none in production (see EngineHooks)
        self.state: ServerState | None = None  # built by load()
        self.exit_code = EXIT_OK
        self.grpc: Any = None  # the gRPC front end, when --grpc-port >= 0
        self.shutdown_failures: list[str] = []  # the shutdown steps that failed, in order (each one logged)
        self.step_timeout_s = SHUTDOWN_STEP_TIMEOUT_S  # how long one shutdown step may take
        self._stop = asyncio.Event()  # set by the first signal or engine death: main_loop returns
        self._signals = 0
        self._http: _Uvicorn | None = None
        self._http_task: asyncio.Task | None = None
        self._lag_task: asyncio.Task | None = None
        self._keys_task: asyncio.Task | None = None  # polls the keys file (--api-keys) for a change
        self._traces_endpoint = ""  # the OTLP/HTTP URL traces go to (otel.traces_endpoint); "" = off

    def load(self) -> ServerState:
        # Where traces go (flag or OTEL_* variables) is settled before the model loads: a bad URL fails fast.
        self._traces_endpoint = traces_endpoint(self.config.server.otlp_traces_endpoint)
        self.state = build_state(self.config, self.hooks)
        if self.config.engine.batch_invariant and self.state.selftest and not self.state.selftest.passed:
            self.exit_code = EXIT_SELFTEST_FAILED
        return self.state

    async def serve(self) -> int:
        if self.state is None:
            self.load()
        if self.exit_code == EXIT_SELFTEST_FAILED:
            log.error("refusing to serve: batch invariance is on but the self-test failed on this machine; "
                      "run with --no-batch-invariant to serve without the guarantee")
            return self.exit_code
        try:
            await self.startup()
        except Exception:
            log.error("start-up failed; stopping what did start", exc_info=True)
            await self.shutdown()
            raise
        try:
            await self.main_loop()
        finally:
            await self.shutdown()
        return self.exit_code

    async def startup(self) -> None:
        """Start the engine, install the signal handlers, bind and start HTTP and gRPC; return once serving."""
        state, sc = self.state, self.config.server
        assert state is not None, "load() first"
        loop = asyncio.get_running_loop()
        state.engine.death_observers.append(lambda why: loop.call_soon_threadsafe(self._on_engine_death, why))
        state.engine.start()
        state.metrics.engine_alive.set(1)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        if state.gate.keys_file:  # --api-keys: SIGHUP, or the file changing, puts it in force again
            loop.add_signal_handler(signal.SIGHUP, self.reload_keys, "SIGHUP")
            self._keys_task = asyncio.create_task(self._watch_keys())
        self._lag_task = asyncio.create_task(sample_loop_lag(state.metrics))
        if self._traces_endpoint:
            from .otel import Tracing

            state.tracing = Tracing(self._traces_endpoint, state.model_name, str(state.fingerprint), state.metrics)
            log.info("exporting traces", extra={"fields": {"otlp_endpoint": self._traces_endpoint}})

        sock = _bind(sc.host, sc.http_port)
        http_port = sock.getsockname()[1]
        app = create_app(state)
        mount_console(app, state)  # the web console: /, /playground, /static/*, /v1/console/*
        # The connection's own limits (head size and count, header and body deadlines, idle connections) are
        # EdgeHttpProtocol's; a WebSocket frame or message over --max-request-bytes is closed 1009 by websockets.
        ucfg = uvicorn.Config(Envelope(app, state), log_config=None, access_log=False,
                              http=edge_protocol(EdgeLimits.of(sc), self._count_edge_refusal),  # type: ignore[arg-type]
                              lifespan="off", ws_max_size=sc.max_request_bytes, timeout_graceful_shutdown=3,
                              ssl_certfile=sc.tls_cert or None, ssl_keyfile=sc.tls_key or None,
                              timeout_keep_alive=HTTP_KEEP_ALIVE_S)
        self._http = _Uvicorn(ucfg)
        self._http_task = asyncio.create_task(self._http.serve(sockets=[sock]))
        grpc_port = -1
        if sc.grpc_port >= 0:
            from .grpc.server import GrpcFrontend

            self.grpc = GrpcFrontend(state)
            grpc_port = await self.grpc.start(sc.host, sc.grpc_port)
        while not self._http.started and not self._http_task.done():
            await asyncio.sleep(0.01)
        scheme = "https" if sc.tls_cert else "http"
        log.info("serving", extra={"fields": {"http": f"{scheme}://{sc.host}:{http_port}",
                                              "grpc": f"{sc.host}:{grpc_port}" if grpc_port >= 0 else "off",
                                              "pid": os.getpid()}})
        if sc.ready_file:
            write_ready_file(sc.ready_file, http_port, grpc_port, os.getpid())

    def _count_edge_refusal(self, reason: str) -> None:
        if self.state is not None and self.state.metrics is not None:
            self.state.metrics.edge_refusals.labels(reason).inc()

    async def main_loop(self) -> None:
        """Serve until the first signal or the engine's death."""
        await self._stop.wait()

    async def shutdown(self) -> None:
        """Drain (unless the engine died), then stop gRPC, HTTP and the engine, in that order.

        Every step runs even when one before it failed, each within its bound: a failure is logged with
        its step and counted in shutdown_failures, never swallowed, and the process still exits."""
        if self.exit_code == EXIT_OK and self.state is not None and self._stop.is_set():
            await self._step("drain", self._drain, None)  # bounded by --drain-timeout itself
        if self._http is not None:
            self._http.should_exit = True
        if self.grpc is not None:
            await self._step("grpc", lambda: self.grpc.stop(grace=1.0), self.step_timeout_s)
        if self._http_task is not None:
            task = self._http_task
            await self._step("http", lambda: task, self.step_timeout_s)
        for task in (self._lag_task, self._keys_task):
            if task is not None:
                task.cancel()
        if self.state is not None:
            # On the loop, not in a worker thread: asyncio.run would wait for a stuck worker at exit. The
            # engine's join has its own timeout.
            await self._step("engine", self.state.engine.shutdown, None)
        if getattr(self.state, "tracing", None) is not None:  # a state may be partial (a failed start-up)
            tracing = self.state.tracing
            await self._step("tracing", lambda: _flushed(tracing), None)  # bounded by otel.SHUTDOWN_TIMEOUT_S
        fields: dict[str, Any] = {"exit_code": self.exit_code}
        if self.shutdown_failures:
            fields["shutdown_failures"] = list(self.shutdown_failures)
        log.info("stopped", extra={"fields": fields})

    async def _step(self, name: str, run: Callable[[], Any], timeout: float | None) -> None:
        """Run one shutdown step (a function, or one returning an awaitable) within `timeout`; log and
        count its failure."""
        try:
            result = run()
            if inspect.isawaitable(result):
                await asyncio.wait_for(result, timeout)
        except Exception as e:  # asyncio.TimeoutError included; a cancellation of shutdown itself propagates
            self.shutdown_failures.append(name)
            log.error("shutdown step failed", exc_info=not isinstance(e, asyncio.TimeoutError),
                      extra={"fields": {"step": name, "error": f"{type(e).__name__}: {e}",
                                        "failures": len(self.shutdown_failures)}})

    async def _drain(self) -> None:
        state = self.state
        assert state is not None
        timeout = self.config.server.drain_timeout
        t0 = time.monotonic()
        log.info("draining", extra={"fields": {"in_flight": state.engine.num_in_flight, "timeout_s": timeout}})
        while state.engine.num_in_flight > 0 and time.monotonic() - t0 < timeout and self._signals < 2:
            await asyncio.sleep(0.05)
        if state.engine.num_in_flight > 0:
            n = state.streams.cut_all("drain_timeout")
            log.warning("drain timeout: ending open streams with an error event", extra={"fields": {"streams": n}})
        t1 = time.monotonic()
        while state.streams.open and time.monotonic() - t1 < 5:  # let final events reach the sockets
            await asyncio.sleep(0.02)
        log.info("drained", extra={"fields": {"seconds": round(time.monotonic() - t0, 2)}})

    def reload_keys(self, why: str) -> bool:
        """Put the keys file in force again (api/tenancy.py Gate.reload): admitted requests and open streams go
        on as the tenant they were admitted as; a removed key gets 401 from its next request. A file that does
        not load is logged, and the keys in force stay. Returns whether it loaded."""
        state = self.state
        assert state is not None
        try:
            state.gate.reload()
        except ConfigError as e:
            log.error("keys file not reloaded; the keys in force stay", extra={"fields": {"why": why,
                                                                                          "error": str(e)}})
            return False
        if state.metrics is not None:
            state.metrics.add_tenants(state.gate.tenant_names)
        return True

    async def _watch_keys(self) -> None:
        """Reload the keys file when its modification time changes (polled every KEYS_POLL_S)."""
        assert self.state is not None
        while True:
            await asyncio.sleep(KEYS_POLL_S)
            if self.state.gate.changed_on_disk():
                self.reload_keys("file changed")

    def _begin_drain(self) -> None:
        assert self.state is not None
        self.state.draining = True
        if self.grpc is not None:
            self.grpc.set_serving(False)
        self._stop.set()

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("signal received: draining", extra={"fields": {"signal": signal.Signals(sig).name}})
            self._begin_drain()
        else:
            log.warning("second signal: exiting now")
            logging.shutdown()
            os._exit(EXIT_FORCED)

    def _on_engine_death(self, why: str) -> None:
        log.error("engine died; going unhealthy and exiting", extra={"fields": {"reason": why}})
        assert self.state is not None
        self.state.metrics.engine_alive.set(0)
        self.exit_code = EXIT_ENGINE_DEAD
        if self.grpc is not None:
            self.grpc.set_serving(False)
        asyncio.get_running_loop().call_later(1.0, self._stop.set)  # let error events reach the clients


def _flushed(tracing: Any) -> None:
    """Flush and stop the trace exporter; a collector that does not answer in time is given up on."""
    if not tracing.shutdown():
        raise TimeoutError("the trace collector did not take the last spans in time; they are dropped")
