"""A real OTLP/HTTP trace receiver on 127.0.0.1 for the tracing tests: it decodes each POST /v1/traces body as an
ExportTraceServiceRequest (opentelemetry-proto) and keeps its spans, as a collector would.

`mode` plays a collector's failures: "ok" answers 200; "hang" takes the request and never answers (a collector
that accepts connections but is stuck: the exporter waits out its timeout), until `mode` changes back.
"""

from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                       ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def value(v: AnyValue) -> Any:
    """An OTLP attribute value as Python."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class Span:
    """One received span, its ids as hex and its attributes as a dict."""

    def __init__(self, span: Any, resource: dict[str, Any]) -> None:
        self.raw = span
        self.name: str = span.name
        self.trace_id = span.trace_id.hex()
        self.span_id = span.span_id.hex()
        self.parent_id = span.parent_span_id.hex()
        self.kind: int = span.kind
        self.start_ns: int = span.start_time_unix_nano
        self.end_ns: int = span.end_time_unix_nano
        self.attrs = {a.key: value(a.value) for a in span.attributes}
        self.events = [(e.name, e.time_unix_nano, {a.key: value(a.value) for a in e.attributes}) for e in span.events]
        self.status_code: int = span.status.code  # 0 unset, 1 ok, 2 error
        self.status_message: str = span.status.message
        self.resource = resource

    def __repr__(self) -> str:
        return f"Span({self.name!r}, trace={self.trace_id[:8]}, status={self.status_code})"


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.requests = 0  # export requests received, answered or not
        self.mode = "ok"
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._lock:
                    receiver.requests += 1
                while receiver.mode == "hang":  # stuck: the exporter's timeout ends the wait on its side
                    time.sleep(0.05)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                got = []
                for rs in req.resource_spans:
                    resource = {a.key: value(a.value) for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        got += [Span(s, resource) for s in ss.spans]
                with receiver._lock:
                    receiver.spans += got
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def find(self, pred: Callable[[Span], bool]) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if pred(s)]

    def wait_trace(self, trace_id: str, count: int, timeout: float = 30.0) -> list[Span]:
        """The spans of `trace_id` once at least `count` have arrived; AssertionError after `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.find(lambda s: s.trace_id == trace_id)
            if len(got) >= count:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(got)} of {count} spans of trace {trace_id} arrived in {timeout} s: {got}")
            time.sleep(0.05)

    def close(self) -> None:
        self.mode = "ok"
        self.server.shutdown()
        self.server.server_close()
