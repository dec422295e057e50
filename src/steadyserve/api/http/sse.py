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
from typing import Any, AsyncIterator, Awaitable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..streams import StreamHandle
from .openai_format import Accumulated, Formatter, sum_usage
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
    """One SSE stream carrying one or more choices (batched prompts, n > 1): each choice is an engine request with its
    own handle and Formatter (whose chunks carry the choice's index). The stream ends once every choice has
    ended, with `data: [DONE]`; a choice that fails ends the whole stream with its error event (the other
    choices' requests are aborted), so an HTTP request never half-succeeds silently."""

    media_type = "text/event-stream"

    def __init__(self, handle: StreamHandle | list[StreamHandle], fmt: Formatter | list[Formatter],
                 want_logprobs: bool, include_usage: bool, stall_timeout: float, on_close: Any = None,
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
        self.on_close = on_close
        self.n = n  # choices per prompt: usage counts each prompt once

    async def _merged(self) -> AsyncIterator[tuple[int, list]]:
        """(choice index, batch) as the choices' engine requests produce them; one reader task per choice."""
        if len(self.handles) == 1:  # the common case, without the tasks
            async for batch in self.handles[0].batches():
                yield 0, batch
            return
        queue: asyncio.Queue[tuple[int, list | None]] = asyncio.Queue()

        async def read(i: int, h: StreamHandle) -> None:
            try:
                async for batch in h.batches():
                    await queue.put((i, batch))
            finally:
                await queue.put((i, None))

        readers = [asyncio.create_task(read(i, h)) for i, h in enumerate(self.handles)]
        try:
            open_choices = len(readers)
            while open_choices:
                items = [await queue.get()]
                while not queue.empty():  # everything available at once: a slow reader gets fewer, bigger batches
                    items.append(queue.get_nowait())
                merged: dict[int, list] = {}  # choice -> its outputs in order
                for i, batch in items:
                    if batch is None:
                        open_choices -= 1
                    else:
                        merged.setdefault(i, []).extend(batch)
                for i, batch in merged.items():
                    yield i, batch
        finally:
            for r in readers:
                r.cancel()

    def _cut_all(self, reason: str) -> None:
        for h in self.handles:
            h.cut(reason)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = scope.get("state", {}).get("transport")
        h0 = self.handles[0]  # carries the response's send backlog
        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()
            self._cut_all("client_disconnect")

        watcher = asyncio.create_task(watch())

        async def emit(data: bytes) -> None:
            await guarded_send(send({"type": "http.response.body", "body": data, "more_body": True}), len(data), h0,
                               transport, self.stall_timeout)

        accs = [Accumulated() for _ in self.handles]
        pending: list[list] = [[] for _ in self.handles]
        num_open = len(self.handles)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for i, batch in self._merged():
                h, fmt = self.handles[i], self.fmts[i]
                for out in batch:
                    accs[i].add(out)
                last = batch[-1]
                if disconnected.is_set():
                    break
                problem = h.error_for(last) if last.finished else None
                if problem is not None:
                    # Tokens generated before the failure (a fast engine puts them in the same batch) go
                    # out first: the client sees what was produced, then why the stream ended.
                    before = pending[i] + batch[:-1]
                    if any(o.new_token_ids or o.text_delta for o in before):
                        await emit(sse_event(fmt.chunk(before, self.want_logprobs)))
                    code, message = problem
                    await emit(sse_event(error_body(message, "server_error" if code != "request_error"
                                                    else "invalid_request_error", None, code)))
                    await emit(DONE)
                    break
                # A token whose text is still held back (half a UTF-8 character, a possible stop
                # string) is sent with its logprobs if asked, else with the next batch.
                if last.finished or any(o.text_delta or o.prompt_logprobs is not None or
                                        (self.want_logprobs and o.logprobs) for o in batch):
                    await emit(sse_event(fmt.chunk(pending[i] + batch, self.want_logprobs)))
                    pending[i] = []
                else:
                    pending[i] += batch
                if last.finished:
                    num_open -= 1
                    if num_open == 0:
                        if self.include_usage:
                            await emit(sse_event(fmt.usage_chunk(sum_usage(accs, self.n))))
                        await emit(DONE)
            if not disconnected.is_set():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except StreamStalled:
            self._cut_all("stall")
            if transport is not None:
                transport.abort()  # a stalled client gets no more bytes and holds no buffer
        except OSError:  # the client went away mid-write
            self._cut_all("client_disconnect")
        finally:
            watcher.cancel()
            for h in self.handles:
                h.stream.abort()
                h.registry.close(h)
                h.backlog_bytes = 0
            if self.on_close is not None:
                self.on_close()
