"""The server process: explicit start-up, serve, drain and shutdown.

startup(): load the model, size the KV cache, run the batch-invariance
self-test, start the engine thread. serve(): HTTP (uvicorn) and gRPC on one
event loop, over one engine. On SIGTERM: go unready at once, refuse new work
with 503 / UNAVAILABLE, let in-flight streams finish for up to
--drain-timeout, then exit 0. A second signal exits at once. If the engine
loop dies, health goes NOT_SERVING, open streams get error events, and the
process exits non-zero within seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import uvicorn

from ..config import Config
from ..engine.async_engine import AsyncEngine
from ..engine.engine import LLMEngine
from ..engine.model_thread import ModelThread
from ..engine.selftest import SelfTestResult, run_selftest
from ..metrics import Metrics, sample_loop_lag
from ..models.loader import Fingerprint, LoadedModel, load_model
from ..numerics import resolve as resolve_numerics
from .http.app import create_app
from .http.envelope import Envelope
from .state import ServerState
from .streams import StreamRegistry

log = logging.getLogger("steadyserve.server")

EXIT_OK, EXIT_ENGINE_DEAD, EXIT_SELFTEST_FAILED, EXIT_FORCED = 0, 3, 4, 1


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers: the Server drains first, then tells it to exit."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class EngineHooks:
    """Functions run on the engine while the server starts, on the model thread. Production passes none; the
    test suite's entry point (steadyserve.testing.serve) installs its fault and drift hooks through them."""

    after_engine: list[Callable[[LLMEngine], None]] = field(default_factory=list)  # before the self-test
    after_selftest: list[Callable[[LLMEngine], None]] = field(default_factory=list)  # after it


def _load_and_check(config: Config, hooks: EngineHooks) -> tuple[LoadedModel, LLMEngine, SelfTestResult]:
    """Load the model, size the KV cache, run the self-test (on the model thread)."""
    mc, ec = config.model, config.engine
    loaded = load_model(mc.path, mc.device, mc.dtype, batch_invariant=ec.batch_invariant, row_tile=ec.row_tile,
                        max_model_len=ec.max_model_len, name=mc.name, cache_dir=mc.cache_dir,
                        attention=ec.attention, block_size=ec.block_size)
    log.info("model loaded", extra={"fields": {
        "model": loaded.name, "architecture": loaded.args.architecture, "params": loaded.args.num_params,
        "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
        "load_s": round(loaded.load_seconds, 2), "cached": loaded.from_cache, "context": loaded.max_model_len}})
    engine = LLMEngine(loaded, ec)
    for hook in hooks.after_engine:
        hook(engine)
    log.info("kv cache allocated", extra={"fields": {
        "budget_bytes": ec.kv_cache_memory, "blocks": engine.kv.num_blocks, "block_size": ec.block_size,
        "token_capacity": engine.kv.num_blocks * ec.block_size, "max_num_seqs": ec.max_num_seqs,
        "max_queue": ec.max_queue, "threads": ec.num_threads}})
    selftest = run_selftest(engine)
    if ec.batch_invariant:
        (log.info if selftest.passed else log.error)("batch-invariance self-test", extra={"fields": {
            "passed": selftest.passed, "detail": selftest.detail}})
    else:
        log.warning("batch invariance is OFF (--no-batch-invariant): logprobs depend on batch composition",
                    extra={"fields": {"selftest": selftest.detail}})
    for hook in hooks.after_selftest:
        hook(engine)
    return loaded, engine, selftest


def build_state(config: Config, hooks: EngineHooks | None = None) -> ServerState:
    """Load the model and self-test it on the model thread that will run the engine (see model_thread.py)."""
    hooks = hooks or EngineHooks()
    ec = config.engine
    numerics = resolve_numerics(ec.numerics)  # refuses a process that cannot compute on the asked path
    model_thread = ModelThread()
    try:
        loaded, engine, selftest = model_thread.call(lambda: _load_and_check(config, hooks))
    except BaseException:
        model_thread.close()
        raise
    fp = Fingerprint(loaded.weights_hash[:12], str(loaded.dtype).removeprefix("torch."), str(loaded.device),
                     ec.batch_invariant and selftest.passed, loaded.model.kernel_id, numerics.numerics_id)
    log.info("model fingerprint", extra={"fields": {"fingerprint": str(fp)}})
    async_engine = AsyncEngine(engine, ec.max_queue, model_thread)
    metrics = Metrics(loaded.name, str(fp), fp.device, fp.dtype, fp.batch_invariant)
    async_engine.step_observers.append(metrics.on_step)
    async_engine.state_observers.append(metrics.on_state)
    metrics.device_mismatch.set(0 if _device_matches(config.model.device, fp.device) else 1)
    state = ServerState(config=config, loaded=loaded, engine=async_engine, fingerprint=fp,
                        selftest=selftest if ec.batch_invariant else None, metrics=metrics,
                        streams=StreamRegistry(metrics))
    metrics.backlog_sources[0] = state.streams.backlog_bytes
    return state


# Kernel send buffer of each HTTP connection (accepted sockets inherit it from the listener; Linux
# doubles it). Left to autotuning it grows to tcp_wmem's max (4 MiB): a client that stops reading
# would then hide megabytes before a write blocks, so --stall-timeout could not see the stall for
# a whole long stream, and each stalled stream would pin that much kernel memory.
SEND_BUFFER_BYTES = 128 * 1024


def _device_matches(asked: str, actual: str) -> bool:
    """`auto` matches anything; `cuda` matches any CUDA device; otherwise exactly."""
    return asked == "auto" or actual == asked or (asked == "cuda" and actual.startswith("cuda:"))


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
    def __init__(self, config: Config, hooks: EngineHooks | None = None) -> None:
        self.config = config
        self.hooks = hooks  # start-up hooks on the engine: none in production (see EngineHooks)
        self.state: ServerState | None = None
        self.exit_code = EXIT_OK
        self._stop = asyncio.Event()
        self._signals = 0
        self.grpc: Any = None

    def startup(self) -> ServerState:
        self.state = build_state(self.config, self.hooks)
        if self.config.engine.batch_invariant and self.state.selftest and not self.state.selftest.passed:
            self.exit_code = EXIT_SELFTEST_FAILED
        return self.state

    async def serve(self) -> int:
        state = self.state or self.startup()
        if self.exit_code == EXIT_SELFTEST_FAILED:
            log.error("refusing to serve: batch invariance is on but the self-test failed on this machine; "
                      "run with --no-batch-invariant to serve without the guarantee")
            return self.exit_code
        sc = self.config.server
        loop = asyncio.get_running_loop()
        state.engine.death_observers.append(lambda why: loop.call_soon_threadsafe(self._on_engine_death, why))
        state.engine.start()
        state.metrics.engine_alive.set(1)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        lag_task = asyncio.create_task(sample_loop_lag(state.metrics))

        sock = _bind(sc.host, sc.http_port)
        http_port = sock.getsockname()[1]
        ucfg = uvicorn.Config(Envelope(create_app(state), state), log_config=None, access_log=False,
                              lifespan="off", ws_max_size=sc.max_request_bytes, timeout_graceful_shutdown=3,
                              ssl_certfile=sc.tls_cert or None, ssl_keyfile=sc.tls_key or None,
                              timeout_keep_alive=5)
        http = _Uvicorn(ucfg)
        http_task = asyncio.create_task(http.serve(sockets=[sock]))
        grpc_port = -1
        if sc.grpc_port >= 0:
            from .grpc.server import GrpcFrontend

            self.grpc = GrpcFrontend(state)
            grpc_port = await self.grpc.start(sc.host, sc.grpc_port)
        while not http.started and not http_task.done():
            await asyncio.sleep(0.01)
        scheme = "https" if sc.tls_cert else "http"
        log.info("serving", extra={"fields": {"http": f"{scheme}://{sc.host}:{http_port}",
                                              "grpc": f"{sc.host}:{grpc_port}" if grpc_port >= 0 else "off",
                                              "pid": os.getpid()}})
        if sc.ready_file:
            # Atomically (write, then rename): a poller must never read a half-written file.
            tmp = Path(sc.ready_file + ".tmp")
            tmp.write_text(json.dumps({"http_port": http_port, "grpc_port": grpc_port, "pid": os.getpid()}))
            os.replace(tmp, sc.ready_file)
        await self._stop.wait()
        if self.exit_code == EXIT_OK:
            await self._drain()
        http.should_exit = True
        if self.grpc is not None:
            await self.grpc.stop(grace=1.0)
        try:
            await asyncio.wait_for(http_task, 10)
        except (asyncio.TimeoutError, Exception):
            pass
        lag_task.cancel()
        state.engine.shutdown()
        log.info("stopped", extra={"fields": {"exit_code": self.exit_code}})
        return self.exit_code

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
