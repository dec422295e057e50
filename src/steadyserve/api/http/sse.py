"""Server-sent-event responses that end honestly and never let a slow client stall others.

The engine writes into the request's queue and never waits; this response
reads from it. A client that accepts nothing for `stall_timeout` seconds is
cut (counted, its engine request aborted, its connection aborted). A client
that disconnects is noticed by a watcher on `receive` and its request aborted
at once, not when the next token happens to be written.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..streams import StreamHandle
from .openai_format import Accumulated, Formatter
from .errors import error_body


class StreamStalled(Exception):
    pass


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def guarded_send(sending: Awaitable[None], nbytes: int, handle: StreamHandle, transport: Any,
                       timeout: float) -> None:
    """Await one send of `nbytes`; cut the stream if the client takes nothing for `timeout` s.

    While it waits, the bytes count in the stream's backlog (with what the
    transport still buffers): the server-side view of send-buffer back-pressure.
    """
    handle.backlog_bytes = nbytes + (transport.get_write_buffer_size() if transport is not None else 0)
    try:
        await asyncio.wait_for(sending, timeout)
    except asyncio.TimeoutError:
        handle.cut("stall")
        raise StreamStalled() from None
    handle.backlog_bytes = transport.get_write_buffer_size() if transport is not None else 0


async def watch_disconnect(receive: Receive, handle: StreamHandle) -> None:
    while True:
        message = await receive()
        if message["type"] in ("http.disconnect", "websocket.disconnect"):
            handle.cut("client_disconnect")
            return


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, handle: StreamHandle, fmt: Formatter, want_logprobs: bool, include_usage: bool,
                 stall_timeout: float, on_close: Any = None) -> None:
        self.status_code = 200
        self.background = None
        # Not Response.__init__: it would add content-length: 0 to a body that is a stream.
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.handle = handle
        self.fmt = fmt
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.stall_timeout = stall_timeout
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = scope.get("state", {}).get("transport")
        h = self.handle
        watcher = asyncio.create_task(watch_disconnect(receive, h))

        async def emit(data: bytes) -> None:
            await guarded_send(send({"type": "http.response.body", "body": data, "more_body": True}), len(data), h,
                               transport, self.stall_timeout)

        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            acc = Accumulated()
            pending: list = []
            async for batch in h.batches():
                for out in batch:
                    acc.add(out)
                last = batch[-1]
                if h.end_reason == "client_disconnect":
                    break
                problem = h.error_for(last) if last.finished else None
                if problem is not None:
                    # Tokens generated before the failure (a fast engine puts them in the same batch) go
                    # out first: the client sees what was produced, then why the stream ended.
                    before = pending + batch[:-1]
                    if any(o.new_token_ids or o.text_delta for o in before):
                        await emit(sse_event(self.fmt.chunk(before, self.want_logprobs)))
                    code, message = problem
                    await emit(sse_event(error_body(message, "server_error" if code != "request_error"
                                                    else "invalid_request_error", None, code)))
                    await emit(DONE)
                    break
                # A token whose text is still held back (half a UTF-8 character, a possible stop
                # string) is sent with its logprobs if asked, else with the next batch.
                if last.finished or any(o.text_delta or o.prompt_logprobs is not None or
                                        (self.want_logprobs and o.logprobs) for o in batch):
                    await emit(sse_event(self.fmt.chunk(pending + batch, self.want_logprobs)))
                    pending = []
                else:
                    pending += batch
                if last.finished:
                    if self.include_usage:
                        await emit(sse_event(self.fmt.usage_chunk(acc)))
                    await emit(DONE)
            if h.end_reason != "client_disconnect":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except StreamStalled:
            if transport is not None:
                transport.abort()  # a stalled client gets no more bytes and holds no buffer
        except OSError:  # the client went away mid-write
            h.cut("client_disconnect")
        finally:
            watcher.cancel()
            h.stream.abort()
            h.registry.close(h)
            h.backlog_bytes = 0
            if self.on_close is not None:
                self.on_close()
