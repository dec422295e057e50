"""One request's channel: the one type that carries its outputs from the engine thread to a transport.

`AsyncEngine.submit_all` opens one RequestChannel per client call, for all its choices (batched prompts, n
samples, an embedding's inputs: each one engine request). The engine thread hands each output to the
channel's event loop (`deliver`); the transport reads `Event`s from it and only encodes them. The channel
owns three decisions, each in one place:

- aborting: `cut` is the only code that aborts the channel's engine requests, each at most once, whatever
  asked for it (a gone client, a stalled reader, a deadline, a drain, a transport that left early);
- how the request ends: `_end_of` turns a choice's final output, and the reason it was cut if it was, into a
  finish reason or an error code (END_MESSAGES, and request_error);
- back-pressure: `send` waits on one transport write for at most the stall timeout, counting its bytes as the
  request's backlog meanwhile.

It imports nothing of the front ends: the server's bookkeeping (the metrics of cut streams, the trace's end,
the registry that a drain cuts) reaches it through its `owner` (api/streams.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from .sequence import Accumulated, RequestOutput

log = logging.getLogger("steadyserve.engine")

# The reasons a stream is ended early, with the message its error event carries. A choice that fails alone
# ends with request_error and the engine's own message.
END_MESSAGES = {
    "stall": "the client accepted no data for the stall timeout; stream aborted",
    "deadline": "deadline exceeded",
    "drain_timeout": "server shutting down: drain timeout reached before the stream finished",
    "engine_error": "the engine failed",
    "client_disconnect": "client disconnected",
}


class StreamStalled(Exception):
    """A send waited the stall timeout for the client; every choice was cut with reason `stall`."""


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


class ChannelOwner(Protocol):
    """The server's side of its open channels (api/streams.py's OpenChannels)."""

    def counted(self, reason: str, n: int) -> None:
        """`n` of a channel's streams were ended early for `reason`."""

    def closed(self, channel: "RequestChannel") -> None:
        """The transport is done with `channel`."""


class RequestChannel:
    """The outputs of one client call's choices, as events, from the engine thread to one transport.

        async with channel.watch(disconnected=..., deadline_s=...):
            async for ev in channel: ...   # encode ev; ev.error ends the request

    Iteration ends when every choice finished, or right after the first error event: a request never
    half-succeeds silently. Once the client is gone (`disconnected` returned, or cut("client_disconnect"))
    no outputs are yielded, only the error event that says so, which encoders do not write. Leaving the
    block cuts every unfinished choice (with `unfinished_reason()` when given, so it is counted; the
    transport's own reason otherwise) and tells the owner the channel is closed.
    """

    def __init__(self, request_ids: list[str], abort: Callable[[str], None],
                 loop: asyncio.AbstractEventLoop) -> None:
        n = len(request_ids)
        self.request_ids = request_ids  # the choices' engine request ids, in choice order
        self.loop = loop  # where outputs are delivered: the event loop that submitted the request
        self.accs = [Accumulated() for _ in request_ids]  # each choice's outputs so far, as read
        self.error: tuple[str, str] | None = None  # (code, message) of the error that ended the request
        self.completed = False  # every choice finished with a finish reason
        self.client_gone = False
        self.backlog_bytes = 0  # produced but not yet accepted by the client's socket
        self.owner: ChannelOwner | None = None  # set by the server's registry when it opens the channel
        self._abort = abort  # AsyncEngine.abort: frees the engine request's slot at the next step
        self._queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        self._observers: list[list[Callable[[RequestOutput], None]]] = [[] for _ in range(n)]
        self._engine_done = [False] * n  # the engine delivered the choice's final output: nothing to abort
        self._aborted = [False] * n  # an abort was sent to the engine (once at most)
        self._cut_reasons: list[str | None] = [None] * n  # why each choice was ended early (counted once)
        self._disconnected: Awaitable[Any] | None = None
        self._deadline_s: float | None = None
        self._unfinished_reason: Callable[[], str] | None = None
        self._watcher: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None

    # ---- the engine's side (on self.loop) ----------------------------------
    def observe(self, index: int, fn: Callable[[RequestOutput], None]) -> None:
        """Run fn on each output of choice `index` as it is delivered, read or not: bookkeeping (metrics, the
        request log line, traces) must not depend on a reader."""
        self._observers[index].append(fn)

    def deliver(self, index: int, out: RequestOutput) -> None:
        """One output of choice `index`, from the engine thread (called on self.loop)."""
        for fn in self._observers[index]:
            try:
                fn(out)
            except Exception:  # a bookkeeping bug must not lose the output
                log.exception("output observer failed")
        if out.finished:
            self._engine_done[index] = True
        self._queue.put_nowait((index, out))

    # ---- the one abort path --------------------------------------------------
    def cut(self, reason: str | None) -> None:
        """End every unfinished choice early for `reason` (END_MESSAGES; None: the request already ended, no
        reason to count); the engine frees their slots at its next step. The only place that aborts."""
        if reason == "client_disconnect":
            self.client_gone = True
        counted = 0
        for i, rid in enumerate(self.request_ids):
            # A stall is counted even when the engine had already finished: the client never got the end.
            if reason is not None and self._cut_reasons[i] is None and (not self._engine_done[i] or reason == "stall"):
                self._cut_reasons[i] = reason
                counted += 1
            if not self._engine_done[i] and not self._aborted[i]:
                self._aborted[i] = True
                self._abort(rid)
        if counted and self.owner is not None:
            self.owner.counted(reason, counted)  # type: ignore[arg-type]  # counted > 0: reason is set

    # ---- the one end decision ------------------------------------------------
    def _end_of(self, i: int, out: RequestOutput) -> tuple[str, str] | None:
        """(code, message) if choice i's final output `out` ends the request in an error, else None (a finish
        reason the encoders report as it is)."""
        if out.finish_reason == "error":
            code = "engine_error" if (out.error or "").startswith("engine failed") else "request_error"
            if code == "engine_error" and self._cut_reasons[i] is None:
                self._cut_reasons[i] = "engine_error"
                if self.owner is not None:
                    self.owner.counted("engine_error", 1)
            return code, out.error or "request failed"
        reason = self._cut_reasons[i]
        if out.finish_reason == "abort" and reason is not None:
            return reason, END_MESSAGES.get(reason, reason)
        return None

    # ---- the transport's side --------------------------------------------------
    def watch(self, disconnected: Awaitable[Any] | None = None, deadline_s: float | None = None,
              unfinished_reason: Callable[[], str] | None = None) -> "RequestChannel":
        """Set what ends the channel early while the transport holds it (`async with channel.watch(...)`):
        `disconnected` returns when the client is gone; `deadline_s` from now the request is cut; on leaving
        early, unfinished choices are cut with `unfinished_reason()`."""
        self._disconnected, self._deadline_s, self._unfinished_reason = disconnected, deadline_s, unfinished_reason
        return self

    async def __aenter__(self) -> "RequestChannel":
        if self._disconnected is not None:
            self._watcher = asyncio.create_task(self._watch(self._disconnected))
        if self._deadline_s is not None:
            self._timer = self.loop.call_later(max(0.0, self._deadline_s), self.cut, "deadline")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self._timer is not None:
            self._timer.cancel()
        unfinished = not all(self._engine_done)  # left before the engine finished: cancelled, failed, gone
        self.cut(self._unfinished_reason() if unfinished and self._unfinished_reason is not None else None)
        self.backlog_bytes = 0
        if self.owner is not None:
            self.owner.closed(self)

    async def _watch(self, disconnected: Awaitable[Any]) -> None:
        await disconnected
        self.cut("client_disconnect")

    async def send(self, sending: Awaitable[None], nbytes: int, timeout: float,
                   buffered: Callable[[], int] | None = None) -> None:
        """Await one send of `nbytes`; if the client takes nothing for `timeout` s, cut every choice (stall)
        and raise StreamStalled. While it waits, the bytes count as the request's backlog, with what the
        transport still buffers (`buffered`): the server-side view of send-buffer back-pressure."""
        self.backlog_bytes = nbytes + (buffered() if buffered is not None else 0)
        try:
            # In this task: wait_for wraps each send in a task of its own (3.11), once per event per stream
            # (9.2 against 3.2 us per send, Intel Xeon; at 64 streams, 0.4 ms of CPU per engine step).
            async with asyncio.timeout(timeout):
                await sending
        except TimeoutError:
            self.cut("stall")
            raise StreamStalled() from None
        self.backlog_bytes = buffered() if buffered is not None else 0

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        """Everything available at once, one event per choice that has news: a slow reader gets fewer, bigger
        events."""
        num_open = len(self.request_ids)
        while num_open:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            merged: dict[int, list[RequestOutput]] = {}  # choice -> its outputs in order
            for i, out in items:
                merged.setdefault(i, []).append(out)
            for i, batch in merged.items():
                for out in batch:
                    self.accs[i].add(out)
                last = batch[-1]
                if last.finished:
                    problem = self._end_of(i, last)
                    if problem is not None:
                        self.error = problem
                        yield Event(i, batch, problem)
                        return
                    num_open -= 1
                if not self.client_gone:
                    yield Event(i, batch)
        self.completed = True

    async def drain(self) -> "RequestChannel":
        """Read every event (a whole, unstreamed answer): afterwards `accs` holds the choices' outputs, or
        `error` why the request ended."""
        async with self:
            async for _ in self:
                pass
        return self
