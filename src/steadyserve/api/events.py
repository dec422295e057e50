"""How a request's end reads on each transport, and the usage of its choices added up.

A request's outputs reach a transport through its RequestChannel (engine/channel.py), which decides how the
request ended: a finish reason, or an error code (stall, client_disconnect, drain_timeout, deadline,
engine_error, request_error). This module is the one table that maps an error code to each transport's
status (END_STATUS); the transports only encode.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.channel import Event, RequestChannel, StreamStalled
from ..engine.sequence import Accumulated  # Accumulated: the one fold, shared with offline use

__all__ = ["END_STATUS", "Accumulated", "EndStatus", "Event", "OTHER_END", "RequestChannel", "StreamStalled",
           "end_status", "sum_usage"]


@dataclass(frozen=True)
class EndStatus:
    """How every transport reports a request that ended with an error code (`RequestChannel.error`)."""

    http: int  # the status of a whole (unstreamed) HTTP response; streams have sent 200 already
    ws_close: int  # the WebSocket close code
    grpc: str  # the name of the grpc.StatusCode (this module imports no transport)
    error_type: str  # the OpenAI error type in the error body (HTTP, SSE and WebSocket alike)


# The one end-code table. A failure of this request alone (request_error, e.g. non-finite logits) is the
# request's: 400, close 1008, ABORTED. A gone client gets 499, as nginx logs it: no server fault occurred
# (it never reads the body). A drain is the replica going away: 503, UNAVAILABLE. A failed engine is the one
# INTERNAL. Codes not listed (stall, deadline and any new one) are server-side ends of a healthy request.
END_STATUS: dict[str, EndStatus] = {
    "request_error": EndStatus(400, 1008, "ABORTED", "invalid_request_error"),
    "client_disconnect": EndStatus(499, 1011, "CANCELLED", "invalid_request_error"),
    "drain_timeout": EndStatus(503, 1011, "UNAVAILABLE", "server_error"),
    "engine_error": EndStatus(500, 1011, "INTERNAL", "server_error"),
    "deadline": EndStatus(500, 1011, "DEADLINE_EXCEEDED", "server_error"),
    "stall": EndStatus(500, 1011, "ABORTED", "server_error"),
}
OTHER_END = EndStatus(500, 1011, "ABORTED", "server_error")


def end_status(code: str) -> EndStatus:
    return END_STATUS.get(code, OTHER_END)


def sum_usage(accs: list[Accumulated], n: int = 1) -> Accumulated:
    """The token counts of one request's choices added up, as an Accumulated for its usage(). The choices come
    n per prompt (`n` samples each): a prompt counts once, as OpenAI and vLLM count it, generated tokens all."""
    total = Accumulated()
    for i, a in enumerate(accs):
        if i % n == 0:
            total.num_prompt_tokens += a.num_prompt_tokens
            total.num_cached_tokens += a.num_cached_tokens
        total.num_generated_tokens += a.num_generated_tokens
    return total
