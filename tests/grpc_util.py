"""A gRPC proxy for tests: forwards Generate to a real server and ends every other stream early, cleanly."""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Iterator

import grpc

from steadyserve.client import pb
from steadyserve.api.protos.steadyserve.v1 import inference_pb2_grpc as pb_grpc


class GrpcCuttingProxy(pb_grpc.InferenceServicer):
    """Generate calls 1, 3, 5 ... get `keep` messages from upstream and then status OK, with no `final`.

    It stands for a worker that ends a stream without a finish reason (a bug, or a proxy that closes an
    HTTP/2 stream early): the client sees a well-formed OK end. `cut` counts the streams it cut.
    """

    def __init__(self, upstream: str, keep: int = 3) -> None:
        self.keep = keep
        self.cut = 0
        self.streams = 0
        self._lock = threading.Lock()
        self._upstream = grpc.insecure_channel(upstream)
        self._stub = pb_grpc.InferenceStub(self._upstream)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_InferenceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        with self._lock:
            self.streams += 1
            cut = self.streams % 2 == 1
        call = self._stub.Generate(request, timeout=60)
        sent = 0
        for msg in call:
            if cut and sent == self.keep:
                call.cancel()
                with self._lock:
                    self.cut += 1
                return  # status OK, no final message
            yield msg
            sent += 1

    def close(self) -> None:
        self._server.stop(grace=None)
        self._upstream.close()

    def __enter__(self) -> "GrpcCuttingProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
