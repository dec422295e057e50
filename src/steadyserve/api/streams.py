"""Transport-neutral bookkeeping of open streams: why a stream ended early.

Every stream ends honestly: a finish reason, or an explicit error saying why
(client_disconnect, stall, deadline, drain_timeout, engine_error). The server
keeps the open streams here so that drain and engine death can end them all.
"""

from __future__ import annotations

from typing import AsyncIterator

from ..engine.async_engine import RequestStream
from ..engine.sequence import RequestOutput

END_MESSAGES = {
    "stall": "the client accepted no data for the stall timeout; stream aborted",
    "deadline": "deadline exceeded",
    "drain_timeout": "server shutting down: drain timeout reached before the stream finished",
    "engine_error": "the engine failed",
    "client_disconnect": "client disconnected",
}


class StreamHandle:
    """One open stream of one request."""

    def __init__(self, registry: "StreamRegistry", request_id: str, stream: RequestStream, transport: str) -> None:
        self.registry = registry
        self.request_id = request_id
        self.stream = stream
        self.transport = transport
        self.end_reason: str | None = None  # set when the server or client cuts the stream
        self.backlog_bytes = 0  # produced but not yet accepted by the client's socket

    def batches(self) -> AsyncIterator[list[RequestOutput]]:
        return self.stream.batches()

    def cut(self, reason: str) -> None:
        """End the stream early for `reason`; the engine frees its slot at the next step."""
        # A stall is counted even when the engine had already finished: the client never got the end.
        if self.end_reason is None and (not self.stream.finished or reason == "stall"):
            self.end_reason = reason
            metrics = self.registry.metrics
            if metrics is not None:
                metrics.aborted.labels(reason).inc()
        self.stream.abort()

    def error_for(self, out: RequestOutput) -> tuple[str, str] | None:
        """(code, message) if this final output must be reported as an error, else None."""
        if out.finish_reason == "error":
            code = "engine_error" if (out.error or "").startswith("engine failed") else "request_error"
            if code == "engine_error" and self.end_reason is None:
                self.end_reason = "engine_error"
                if self.registry.metrics is not None:
                    self.registry.metrics.aborted.labels("engine_error").inc()
            return code, out.error or "request failed"
        if out.finish_reason == "abort" and self.end_reason is not None:
            return self.end_reason, END_MESSAGES.get(self.end_reason, self.end_reason)
        return None


class StreamRegistry:
    def __init__(self, metrics=None) -> None:
        self.metrics = metrics
        self.open: dict[int, StreamHandle] = {}

    def open_stream(self, request_id: str, stream: RequestStream, transport: str) -> StreamHandle:
        h = StreamHandle(self, request_id, stream, transport)
        self.open[id(h)] = h
        return h

    def close(self, h: StreamHandle) -> None:
        self.open.pop(id(h), None)

    def cut_all(self, reason: str) -> int:
        handles = list(self.open.values())
        for h in handles:
            h.cut(reason)
        return len(handles)

    def backlog_bytes(self) -> int:
        return sum(h.backlog_bytes for h in list(self.open.values()))
