"""GrpcFrontend: the grpc.aio server of `steadyserve serve`, on the HTTP server's event loop and engine.

It serves steadyserve.v1.Inference, grpc.health.v1.Health and server
reflection on one port. Health is SERVING only while the server is ready
(model loaded, self-test passed, engine alive, not draining); the server
flips it to NOT_SERVING at once on SIGTERM or engine death (set_serving),
and a watcher also notices an engine that died without telling anyone.
Admission is the shared ServerState's, so gRPC and HTTP share one capacity.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ...limits import GRPC_MAX_CONCURRENT_STREAMS
from ..state import ServerState
from ..protos.steadyserve.v1 import inference_pb2, inference_pb2_grpc
from . import SERVICE
from .interceptor import ServerInterceptor
from .servicer import InferenceServicer

log = logging.getLogger("steadyserve.grpc")

Status = health_pb2.HealthCheckResponse.ServingStatus
MAX_SEND_BYTES = 64 * 1024 * 1024  # Score with top-20 alternatives on a long prompt is a few MB
HEALTH_POLL_S = 0.25  # how soon Watch notices a change nobody announced (an engine that died)


def server_options(max_receive_bytes: int) -> list[tuple[str, int]]:
    """Channel arguments of the server: limits, keepalive, and no silent port sharing."""
    return [
        # Past it on one connection, gRPC refuses the new stream (RST_STREAM REFUSED_STREAM) before any handler.
        ("grpc.max_concurrent_streams", GRPC_MAX_CONCURRENT_STREAMS),
        # Bigger requests get RESOURCE_EXHAUSTED from gRPC itself before we parse anything;
        # the limit is HTTP's --max-request-bytes so that both front ends accept the same inputs.
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_SEND_BYTES),
        ("grpc.keepalive_time_ms", 30_000),  # ping idle connections to find dead peers
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # clients may ping every 10 s, not faster
        ("grpc.http2.max_ping_strikes", 2),
        # gRPC sets SO_REUSEPORT by default: a second server on the same port would bind silently and
        # steal half the connections. One port, one server.
        ("grpc.so_reuseport", 0),
    ]


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1.Health computed from the server's state, not from a table someone must keep in sync.

    Known services: "" (the whole server) and steadyserve.v1.Inference; others are NOT_FOUND (Check)
    or SERVICE_UNKNOWN (Watch), as the health protocol says.
    """

    SERVICES = ("", SERVICE)

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.serving = True  # False once the server said so; never goes back
        self.changed = asyncio.Event()

    def status(self) -> int:
        return Status.SERVING if self.serving and self.state.ready else Status.NOT_SERVING

    def set_serving(self, serving: bool) -> None:
        self.serving = serving
        old, self.changed = self.changed, asyncio.Event()  # a fresh event per change: no watcher misses one
        old.set()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
                    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=self.status())

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        last = None
        while True:
            changed = self.changed
            status = self.status() if request.service in self.SERVICES else Status.SERVICE_UNKNOWN
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            try:
                await asyncio.wait_for(changed.wait(), HEALTH_POLL_S)
            except asyncio.TimeoutError:
                pass


class GrpcFrontend:
    """Owns the grpc.aio server. The contract with api/server.py: start, set_serving, stop."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.health = HealthServicer(state)
        self.server: grpc.aio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Bind and start serving; returns the bound port (port 0 picks a free one)."""
        sc = self.state.config.server
        server = grpc.aio.server(interceptors=[ServerInterceptor(self.state)],
                                 options=server_options(sc.max_request_bytes))
        inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(self.state), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if sc.tls_cert:
            creds = grpc.ssl_server_credentials([(Path(sc.tls_key).read_bytes(), Path(sc.tls_cert).read_bytes())])
            bound = server.add_secure_port(address, creds)
        else:
            bound = server.add_insecure_port(address)
        if not bound:  # older grpcio returns 0 instead of raising
            raise RuntimeError(f"gRPC cannot bind {address}")
        await server.start()
        self.server = server
        log.info("grpc serving", extra={"fields": {"address": f"{host}:{bound}", "tls": bool(sc.tls_cert),
                                                   "services": ",".join(names)}})
        return bound

    def set_serving(self, serving: bool) -> None:
        """Flip health at once (called from the signal handler and on engine death)."""
        self.health.set_serving(serving)

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting RPCs; in-flight ones get `grace` seconds (the drain already waited for them)."""
        self.health.set_serving(False)
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
