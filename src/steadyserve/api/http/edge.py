"""The HTTP/1.1 connection's own limits, enforced while bytes arrive, before any route runs (issue 61, item 5).

uvicorn's httptools protocol bounds none of these: it buffers a request head of any size (httptools keeps a
header line in memory until it ends), waits for headers and bodies for ever (its keep-alive timer restarts on
every byte, so one byte a second holds a connection open), never times out a fresh connection that sends
nothing, and keeps any number of idle connections. EdgeHttpProtocol is that protocol with:

  * the request head (request line + headers) at most MAX_HEADER_BYTES, and MAX_HEADER_COUNT header lines: 431;
  * the head complete within --header-timeout of the connection being ready for a request: 408, closed;
  * the body complete within --body-timeout of its head: 408, closed;
  * at most --max-idle-connections connections waiting for a request: past it the longest idle is closed.

Every check is a counter or a timer on the event loop: nothing here waits, and no byte reaches the engine.
A refusal is written by the protocol itself (no route has run), in the API's own JSON shape (Anthropic's under
/v1/messages, OpenAI's elsewhere), with `connection: close`. The limits' values have one owner each:
steadyserve/limits.py for the fixed ones, config.py ServerConfig for the flags.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from ...config import ServerConfig
from ...limits import MAX_HEADER_BYTES, MAX_HEADER_COUNT
from .errors import error_body
from .messages_errors import anthropic_error_body, anthropic_status, is_messages_path


@dataclass(frozen=True)
class EdgeLimits:
    """What one HTTP connection may send before a route runs."""

    max_header_bytes: int  # request line + header lines of one request; past it: 431 header_too_large
    max_header_count: int  # header lines of one request; past it: 431 too_many_headers
    header_timeout_s: float  # from ready-for-a-request to the end of its headers; past it: 408 request_timeout
    body_timeout_s: float  # from the end of the headers to the end of the body; past it: 408 request_timeout
    max_idle_connections: int  # connections waiting for a request; past it the longest idle is closed

    @classmethod
    def of(cls, sc: ServerConfig) -> "EdgeLimits":
        return cls(MAX_HEADER_BYTES, MAX_HEADER_COUNT, sc.header_timeout, sc.body_timeout, sc.max_idle_connections)


class _HeadRefused(Exception):
    """Raised from a parser callback to stop parsing; the refusal itself is in EdgeHttpProtocol._refusal."""


# The idle connections of each uvicorn server (its ServerState), oldest first: shared by its connections.
_IDLE_ATTR = "_steadyserve_idle"


def _idle_of(server_state: Any) -> "OrderedDict[EdgeHttpProtocol, None]":
    idle = getattr(server_state, _IDLE_ATTR, None)
    if idle is None:
        idle = OrderedDict()
        setattr(server_state, _IDLE_ATTR, idle)
    return idle


def edge_protocol(limits: EdgeLimits, on_refusal: Callable[[str], None] | None = None
                  ) -> Callable[..., EdgeHttpProtocol]:
    """The protocol factory for uvicorn.Config(http=...): uvicorn calls it with config, server_state, app_state.
    `on_refusal(reason)` is told of every refusal and idle eviction (the server counts them in its metrics)."""

    def make(*args: Any, **kwargs: Any) -> EdgeHttpProtocol:
        return EdgeHttpProtocol(*args, limits=limits, on_refusal=on_refusal, **kwargs)

    return make


class EdgeHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of EdgeLimits (see the module's docstring)."""

    def __init__(self, *args: Any, limits: EdgeLimits, on_refusal: Callable[[str], None] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._on_refusal = on_refusal  # told the reason of each refusal and idle eviction (metrics)
        self._idle = _idle_of(self.server_state)
        self._deadline: asyncio.TimerHandle | None = None  # the header or body deadline now running
        self._head_done = False  # the current request's headers are all in (its body, if any, is next)
        self._raw_head = 0  # bytes fed while no head was complete: bounds a header line httptools still buffers
        self._head_bytes = 0  # the current head's bytes as the parser reported them (URL, names, values)
        self._head_count = 0  # the current head's header lines
        self._refusal: tuple[int, str, str] | None = None  # (status, code, message) a callback refused with

    # ---- the connection's life ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._idle.pop(self, None)
        super().connection_lost(exc)

    def _await_request(self) -> None:
        """Ready for a request: idle until its first byte, which must lead to a full head within the timeout."""
        self._head_done, self._raw_head, self._head_bytes, self._head_count = False, 0, 0, 0
        self._arm(self.limits.header_timeout_s, self._header_timed_out)
        self._idle[self] = None
        while len(self._idle) > self.limits.max_idle_connections:
            oldest, _ = self._idle.popitem(last=False)  # the longest idle one goes; it has no request to lose
            oldest._cancel_deadline()
            oldest.transport.close()
            self._note("idle_evicted")

    def on_response_complete(self) -> None:
        pipelined = bool(self.pipeline)  # the next request's head is in already
        super().on_response_complete()
        if not pipelined and not self.transport.is_closing():
            self._await_request()

    def handle_websocket_upgrade(self) -> None:
        self._cancel_deadline()  # the WebSocket protocol owns the connection now (ws.py bounds its request)
        self._idle.pop(self, None)
        super().handle_websocket_upgrade()

    # ---- bytes in -----------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._idle.pop(self, None)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:
                return self._refuse(*self._refusal)
            return self._refuse(400, "invalid_http", "invalid HTTP request")
        if not self._head_done:
            # No head completed in this chunk, so all of it is head: this bounds what httptools buffers of a
            # header line that has not ended yet (the callbacks see a line only once it ends).
            self._raw_head += len(data)
            if self._raw_head > self.limits.max_header_bytes:
                self._refuse(*self._too_large())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_done, self._head_bytes, self._head_count = False, 0, 0

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count_head(len(url), 0)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4, 1)  # "name: value\r\n"
        super().on_header(name, value)

    def _count_head(self, size: int, lines: int) -> None:
        self._head_bytes += size
        self._head_count += lines
        if self._head_bytes > self.limits.max_header_bytes:
            self._refusal = self._too_large()
            raise _HeadRefused()
        if self._head_count > self.limits.max_header_count:
            self._refusal = (431, "too_many_headers", f"the request has more than {self.limits.max_header_count} "
                             "header lines")
            raise _HeadRefused()

    def _too_large(self) -> tuple[int, str, str]:
        return 431, "header_too_large", (f"the request line and headers exceed {self.limits.max_header_bytes} "
                                         "bytes")

    def on_headers_complete(self) -> None:
        self._head_done = True
        self._arm(self.limits.body_timeout_s, self._body_timed_out)  # on_message_complete ends it (no body: now)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._cancel_deadline()
        super().on_message_complete()

    # ---- deadlines ----------------------------------------------------------------------------------------
    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(seconds, then)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _header_timed_out(self) -> None:
        self._deadline = None
        if self._raw_head == 0 and not self._head_bytes:  # nothing of a request came: an idle connection
            self._idle.pop(self, None)
            self.transport.close()
            return
        self._refuse(408, "request_timeout", f"the request's headers did not arrive within "
                     f"{self.limits.header_timeout_s:g} s (--header-timeout)")

    def _body_timed_out(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and cycle.response_started:  # the route answered already: only stop reading
            cycle.keep_alive = False
            self.transport.close()
            return
        self._refuse(408, "request_timeout", f"the request's body did not arrive within "
                     f"{self.limits.body_timeout_s:g} s of its headers (--body-timeout)")

    # ---- refusals -----------------------------------------------------------------------------------------
    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer `status` with the API's error body and close: the connection's bytes can no longer be trusted
        to frame a next request. A route still waiting on the body sees the client gone (and answers no one)."""
        self._cancel_deadline()
        self._idle.pop(self, None)
        if self.transport.is_closing():
            return
        self._note(code)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the route's own answer, if it comes, goes nowhere
            cycle.message_event.set()
        path = self.url.decode("latin-1") if isinstance(getattr(self, "url", None), bytes) else ""
        if is_messages_path(path.split("?", 1)[0]):
            body = anthropic_error_body(anthropic_status(status)[1], message)
        else:
            body = error_body(message, "invalid_request_error", None, code)
        payload = json.dumps(body).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\n", b"content-length: ", str(len(payload)).encode(),
                 b"\r\nconnection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + payload)
        self.transport.close()

    def _note(self, reason: str) -> None:
        if self._on_refusal is not None:
            self._on_refusal(reason)
