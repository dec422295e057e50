"""One request's stream of typed events: what every transport only encodes.

SSE, WebSocket, whole JSON responses and gRPC Generate / Score all read a
request's choices (engine requests) through `RequestEvents`: it merges the
choices' outputs as they come, accumulates them, says when a choice ended and
why (a finish reason, or an error code from END_MESSAGES: stall,
client_disconnect, drain_timeout, deadline, engine_error, request_error), and
on leaving aborts what is unfinished and closes the streams' bookkeeping. A
transport keeps only its write mechanics: how bytes reach its socket.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from ..engine.sequence import Accumulated, RequestOutput  # Accumulated: the one fold, shared with offline use
from .streams import StreamHandle
from .tracing import note_end


@dataclass(frozen=True)
class EndStatus:
    """How every transport reports a request that ended with an error code (`RequestEvents.error`)."""

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


class StreamStalled(Exception):
    """A send waited --stall-timeout for the client; every choice was cut with reason `stall`."""


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


@dataclass
class Event:
    """News of one choice: outputs to encode, and whether (and how) the choice ended."""

    index: int  # the choice (0 for a request of one)
    outputs: list[RequestOutput]  # the choice's outputs since its previous event, in order
    error: tuple[str, str] | None = None  # (code, message): the choice, and so the request, ended in an error

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finished

    @property
    def last(self) -> RequestOutput:
        return self.outputs[-1]

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.new_token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text_delta for o in self.outputs)


class RequestEvents:
    """The events of one request's choices, merged as the engine produces them.

        async with RequestEvents(handles, disconnected=...) as events:
            async for ev in events: ...   # encode ev; ev.error ends the request

    Iteration ends when every choice finished, or right after the first error event: the other choices are
    then aborted, so a request never half-succeeds silently. Once the client is gone (`disconnected`
    returned, or a transport called cut("client_disconnect")) no outputs are yielded, only the error event
    that says so, which encoders do not write. Leaving the block aborts every unfinished choice in the engine
    (cut with `unfinished_reason()` when given, so it is counted) and closes the handles.
    """

    def __init__(self, handles: list[StreamHandle], disconnected: Awaitable[Any] | None = None,
                 deadline_s: float | None = None, unfinished_reason: Callable[[], str] | None = None) -> None:
        self.handles = handles
        self.accs = [Accumulated() for _ in handles]  # each choice's outputs so far
        self.error: tuple[str, str] | None = None  # (code, message) of the error that ended the request
        self.completed = False  # every choice finished with a finish reason
        self.client_gone = False
        self._disconnected = disconnected
        self._deadline_s = deadline_s
        self._unfinished_reason = unfinished_reason
        self._watcher: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._iter: AsyncIterator[Event] | None = None

    async def __aenter__(self) -> "RequestEvents":
        if self._disconnected is not None:
            self._watcher = asyncio.create_task(self._watch(self._disconnected))
        if self._deadline_s is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, self._deadline_s), self.cut, "deadline")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._timer is not None:
            self._timer.cancel()
        if self._iter is not None:
            await self._iter.aclose()  # type: ignore[attr-defined]  # stops the choices' reader tasks
        note_end(self.error)  # the request's trace, when tracing is on, ends in this error
        reason = self._unfinished_reason
        for h in self.handles:
            if not h.stream.finished:  # left before the engine finished: cancelled, failed, gone client
                if reason is not None:
                    h.cut(reason())  # counted once, by reason; the engine frees the slot next step
                else:
                    h.stream.abort()
            h.backlog_bytes = 0
            h.registry.close(h)

    async def _watch(self, disconnected: Awaitable[Any]) -> None:
        await disconnected
        self.cut("client_disconnect")

    def cut(self, reason: str) -> None:
        """End every choice early for `reason` (END_MESSAGES); their final outputs say so."""
        if reason == "client_disconnect":
            self.client_gone = True
        for h in self.handles:
            h.cut(reason)

    async def send(self, sending: Awaitable[None], timeout: float) -> None:
        """Await one send; if the client takes nothing for `timeout` s, cut every choice (stall) and raise
        StreamStalled."""
        try:
            await asyncio.wait_for(sending, timeout)
        except asyncio.TimeoutError:
            self.cut("stall")
            raise StreamStalled() from None

    def __aiter__(self) -> AsyncIterator[Event]:
        if self._iter is None:
            self._iter = self._events()
        return self._iter

    async def _events(self) -> AsyncIterator[Event]:
        merged = self._merged()
        try:
            async for event in self._read(merged):
                yield event
        finally:
            await merged.aclose()  # type: ignore[attr-defined]  # its reader tasks end with it

    async def _read(self, merged: AsyncIterator[tuple[int, list[RequestOutput]]]) -> AsyncIterator[Event]:
        num_open = len(self.handles)
        async for i, batch in merged:
            for out in batch:
                self.accs[i].add(out)
            last = batch[-1]
            problem = self.handles[i].error_for(last) if last.finished else None
            if problem is not None:
                self.error = problem
                yield Event(i, batch, problem)
                return
            if last.finished:
                num_open -= 1
            if not self.client_gone:
                yield Event(i, batch)
            if num_open == 0:
                self.completed = True
                return
        if not self.completed and self.error is None:  # a stream that ended without a final output
            self.error = ("engine_error", "no output from the engine")
            yield Event(0, [], self.error)

    async def _merged(self) -> AsyncIterator[tuple[int, list[RequestOutput]]]:
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
            num_reading = len(readers)
            while num_reading:
                items = [await queue.get()]
                while not queue.empty():  # everything available at once: a slow reader gets fewer, bigger batches
                    items.append(queue.get_nowait())
                merged: dict[int, list] = {}  # choice -> its outputs in order
                for i, batch in items:
                    if batch is None:
                        num_reading -= 1
                    else:
                        merged.setdefault(i, []).extend(batch)
                for i, batch in merged.items():
                    yield i, batch
        finally:
            for r in readers:
                r.cancel()
