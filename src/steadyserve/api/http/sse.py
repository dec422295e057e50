"""Server-sent-event responses that end honestly and never let a slow client stall others.

The engine writes into the request's queue and never waits; this response
encodes the request's events (api/events.py) as SSE. A client that accepts
nothing for `stall_timeout` seconds is cut (counted, its engine request
aborted, its connection aborted). A client
that disconnects is noticed by a watcher on `receive` and its request aborted
at once, not when the next token happens to be written.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..events import RequestEvents, StreamStalled, end_status, sum_usage
from ..streams import StreamHandle
from .errors import error_body, error_response
from .openai_format import Formatter


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def guarded_send(events: RequestEvents, sending: Awaitable[None], nbytes: int, transport: Any,
                       timeout: float) -> None:
    """Await one send of `nbytes` (RequestEvents.send cuts the stream after `timeout` s without progress).

    While it waits, the bytes count in the stream's backlog (with what the
    transport still buffers): the server-side view of send-buffer back-pressure.
    """
    handle = events.handles[0]  # carries the response's send backlog
    handle.backlog_bytes = nbytes + (transport.get_write_buffer_size() if transport is not None else 0)
    await events.send(sending, timeout)
    handle.backlog_bytes = transport.get_write_buffer_size() if transport is not None else 0


async def http_disconnect(receive: Receive) -> None:
    """Returns when the client hangs up (the ASGI disconnect message)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect_events(receive: Receive, handles: list[StreamHandle]) -> RequestEvents | Response:
    """A non-streamed request's events to their end: the finished RequestEvents (its accumulators), or
    the error response of the first choice that failed, with the status its end code maps to."""
    async with RequestEvents(handles, disconnected=http_disconnect(receive)) as events:
        async for _ in events:
            pass
    if events.error is not None:
        code, message = events.error
        end = end_status(code)
        return error_response(end.http, message, end.error_type, None, code)
    return events


class SSEResponse(Response):
    """One SSE stream carrying one or more choices (batched prompts, n > 1): each choice is an engine request with its
    own handle and Formatter (whose chunks carry the choice's index). The stream ends once every choice has
    ended, with `data: [DONE]`; a choice that fails ends the whole stream with its error event (the other
    choices' requests are aborted), so an HTTP request never half-succeeds silently."""

    media_type = "text/event-stream"

    def __init__(self, handle: StreamHandle | list[StreamHandle], fmt: Formatter | list[Formatter],
                 want_logprobs: bool, include_usage: bool, stall_timeout: float,
                 n: int = 1) -> None:
        self.status_code = 200
        self.background = None
        # Not Response.__init__: it would add content-length: 0 to a body that is a stream.
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.handles = handle if isinstance(handle, list) else [handle]
        self.fmts = fmt if isinstance(fmt, list) else [fmt]
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.stall_timeout = stall_timeout
        self.n = n  # choices per prompt: usage counts each prompt once

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = scope.get("state", {}).get("transport")
        events = RequestEvents(self.handles, disconnected=http_disconnect(receive))

        async def emit(data: bytes) -> None:
            await guarded_send(events, send({"type": "http.response.body", "body": data, "more_body": True}),
                               len(data), transport, self.stall_timeout)

        pending: list[list] = [[] for _ in self.handles]  # outputs whose text is still held back, per choice
        try:
            async with events:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async for ev in events:
                    if events.client_gone:
                        break
                    fmt = self.fmts[ev.index]
                    if ev.error is not None:
                        # Tokens generated before the failure (a fast engine puts them in the same batch) go
                        # out first: the client sees what was produced, then why the stream ended.
                        before = pending[ev.index] + ev.outputs[:-1]
                        if any(o.new_token_ids or o.text_delta for o in before):
                            for body in fmt.chunks(before, self.want_logprobs):
                                await emit(sse_event(body))
                        code, message = ev.error
                        await emit(sse_event(error_body(message, end_status(code).error_type, None, code)))
                        await emit(DONE)
                        break
                    # A token whose text is still held back (half a UTF-8 character, a possible stop
                    # string) is sent with its logprobs if asked, else with the next batch.
                    if ev.finished or any(o.text_delta or o.prompt_logprobs is not None or
                                          (self.want_logprobs and o.logprobs) for o in ev.outputs):
                        bodies = fmt.chunks(pending[ev.index] + ev.outputs, self.want_logprobs)
                        if ev.finished and fmt.receipt is not None:  # the choice's last chunk carries it
                            bodies[-1]["choices"][0]["receipt"] = fmt.receipt(events.accs[ev.index])
                        for body in bodies:
                            await emit(sse_event(body))
                        pending[ev.index] = []
                    else:
                        pending[ev.index] += ev.outputs
                if events.completed and not events.client_gone:
                    if self.include_usage:
                        await emit(sse_event(self.fmts[0].usage_chunk(sum_usage(events.accs, self.n))))
                    await emit(DONE)
                if not events.client_gone:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        except StreamStalled:
            if transport is not None:
                transport.abort()  # a stalled client gets no more bytes and holds no buffer
        except OSError:  # the client went away mid-write
            events.cut("client_disconnect")

