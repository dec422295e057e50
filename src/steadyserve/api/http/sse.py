"""The one server-sent-events driver: streams that end honestly and never let a slow client stall others.

Chat/completions, the Responses API and Anthropic's Messages API stream through `SSEStream`, each with its
own `SSEEncoder` (what bytes an event becomes); the driver owns the rest: the response start, the order of
events, the end (every choice finished: the encoder's closing events; an error: the encoder's error events),
and the request's RequestChannel (engine/channel.py), which decides how the request ended and is the one
path that aborts it. A client that accepts nothing for `stall_timeout` seconds is cut (counted, its engine
request aborted, its connection aborted). A client that disconnects is noticed by a watcher on `receive`
and its request aborted at once, not when the next token happens to be written.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..events import Event, RequestChannel, StreamStalled, end_status, sum_usage
from .errors import error_body, error_response
from .openai_format import Formatter


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


async def http_disconnect(receive: Receive) -> None:
    """Returns when the client hangs up (the ASGI disconnect message)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect_events(receive: Receive, channel: RequestChannel) -> RequestChannel | Response:
    """A non-streamed request's events to their end: the drained channel (its accumulators), or the error
    response of the first choice that failed, with the status its end code maps to."""
    await channel.watch(disconnected=http_disconnect(receive)).drain()
    if channel.error is not None:
        code, message = channel.error
        end = end_status(code)
        return error_response(end.http, message, end.error_type, None, code)
    return channel


class SSEEncoder(Protocol):
    """One API's server-sent events. Each method returns the bodies to send, one write each."""

    def start(self) -> list[bytes]:
        """Before any event (the API's opening events)."""

    def event(self, ev: Event, channel: RequestChannel) -> list[bytes]:
        """News of one choice, which did not fail."""

    def error(self, ev: Event) -> list[bytes]:
        """The choice failed (ev.error): what it generated first, then why the stream ended."""

    def finish(self, channel: RequestChannel) -> list[bytes]:
        """Every choice finished with a finish reason: the closing events."""


class SSEStream(Response):
    """A streamed answer: one request's channel, encoded by `encoder`. A choice that fails ends the whole
    stream with its error event (the other choices' requests are aborted), so an HTTP request never
    half-succeeds silently."""

    media_type = "text/event-stream"

    def __init__(self, channel: RequestChannel, encoder: SSEEncoder, stall_timeout: float) -> None:
        self.status_code = 200
        self.background = None
        # Not Response.__init__: it would add content-length: 0 to a body that is a stream.
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.channel = channel
        self.encoder = encoder
        self.stall_timeout = stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = scope.get("state", {}).get("transport")
        buffered = transport.get_write_buffer_size if transport is not None else None
        channel, enc = self.channel, self.encoder

        async def emit(bodies: list[bytes]) -> None:
            for data in bodies:
                await channel.send(send({"type": "http.response.body", "body": data, "more_body": True}),
                                   len(data), self.stall_timeout, buffered)

        try:
            async with channel.watch(disconnected=http_disconnect(receive)):
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                await emit(enc.start())
                async for ev in channel:
                    if channel.client_gone:
                        break
                    if ev.error is not None:
                        await emit(enc.error(ev))
                        break
                    await emit(enc.event(ev, channel))
                if channel.completed and not channel.client_gone:
                    await emit(enc.finish(channel))
                if not channel.client_gone:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        except StreamStalled:
            if transport is not None:
                transport.abort()  # a stalled client gets no more bytes and holds no buffer
        except OSError:  # the client went away mid-write
            channel.cut("client_disconnect")


class OpenAIChunks:
    """Chat/completions chunks for one or more choices (batched prompts, n > 1): each choice has its own
    Formatter (whose chunks carry the choice's index); the stream ends with `data: [DONE]`."""

    def __init__(self, fmts: list[Formatter], want_logprobs: bool, include_usage: bool, n: int = 1) -> None:
        self.fmts = fmts
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.n = n  # choices per prompt: usage counts each prompt once
        self.pending: list[list] = [[] for _ in fmts]  # outputs whose text is still held back, per choice

    def start(self) -> list[bytes]:
        return []

    def event(self, ev: Event, channel: RequestChannel) -> list[bytes]:
        fmt = self.fmts[ev.index]
        # A token whose text is still held back (half a UTF-8 character, a possible stop string) is sent with
        # its logprobs if asked, else with the next batch.
        if not (ev.finished or any(o.text_delta or o.prompt_logprobs is not None or
                                   (self.want_logprobs and o.logprobs) for o in ev.outputs)):
            self.pending[ev.index] += ev.outputs
            return []
        bodies = fmt.chunks(self.pending[ev.index] + ev.outputs, self.want_logprobs)
        if ev.finished and fmt.receipt is not None:  # the choice's last chunk carries it
            bodies[-1]["choices"][0]["receipt"] = fmt.receipt(channel.accs[ev.index])
        self.pending[ev.index] = []
        return [sse_event(body) for body in bodies]

    def error(self, ev: Event) -> list[bytes]:
        # Tokens generated before the failure (a fast engine puts them in the same batch) go out first: the
        # client sees what was produced, then why the stream ended.
        fmt = self.fmts[ev.index]
        before = self.pending[ev.index] + ev.outputs[:-1]
        out = []
        if any(o.new_token_ids or o.text_delta for o in before):
            out = [sse_event(body) for body in fmt.chunks(before, self.want_logprobs)]
        code, message = ev.error  # type: ignore[misc]  # error events carry one
        return out + [sse_event(error_body(message, end_status(code).error_type, None, code)), DONE]

    def finish(self, channel: RequestChannel) -> list[bytes]:
        usage = [sse_event(self.fmts[0].usage_chunk(sum_usage(channel.accs, self.n)))] if self.include_usage else []
        return usage + [DONE]


def joined(events: list[bytes]) -> list[bytes]:
    """Several events as one write (none when there are none): how the Responses and Messages encoders send."""
    data = b"".join(events)
    return [data] if data else []
