"""The outermost ASGI layer of the HTTP server (see Envelope)."""

from __future__ import annotations

import time
from typing import Any

from ...limits import valid_request_id
from ..state import ServerState
from ..tenancy import Access, bind, unbind
from ..tracing import RequestTrace
from .errors import error_response
from .messages_errors import anthropic_error, is_messages_path

# gen_ai.operation.name of each traced route before its body is read (a refused request is never parsed).
ROUTE_OPERATIONS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat", "/v1/responses": "chat",
                    "/v1/messages": "chat", "/v1/embeddings": "embeddings", "/v1/stream": "text_completion"}


def _route(scope: dict) -> str:
    return getattr(scope.get("route"), "path", None) or "unmatched"


def trace_end(scope: dict, status: int | None) -> tuple[str, str] | None:
    """The failure a traced HTTP or WebSocket request's answer reports: an HTTP status >= 400, a WebSocket
    closed with a code other than 1000 (normal); None when it reports none."""
    if scope["type"] == "websocket":
        return None if status in (None, 1000) else (f"websocket_close_{status}", f"closed with code {status}")
    if status is None:
        return "no_response", "the request ended before a response was sent"
    return (str(status), f"HTTP {status}") if status >= 400 else None


class Envelope:
    """Outermost ASGI layer: request ids, fingerprint headers, auth, body-size precheck, metrics.

    Who the caller is, and whether it may call the route, is the gate's (api/tenancy.py: the key from
    `Authorization: Bearer`, else `x-api-key` as Anthropic's clients send it); the tenant it answers is the
    current one while the route runs.

    It also keeps the connection's transport (uvicorn's) in scope["state"], so
    streams can measure their send backlog and abort a stalled connection.
    """

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.fingerprint = str(state.fingerprint).encode()

    def _access(self, scope: dict) -> Access:
        headers = dict(scope.get("headers") or [])
        return self.state.gate.http(scope.get("path", ""), headers, scope["type"] == "websocket")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        st = scope.setdefault("state", {})
        if rid and not valid_request_id(rid):
            st["refused_request_id"] = rid  # the inference routes refuse it, as gRPC does (requests.build)
        if not rid or not valid_request_id(rid):
            rid = self.state.new_request_id()  # what the response headers carry, on every route
        st["request_id"] = rid
        st["transport"] = getattr(getattr(send, "__self__", None), "transport", None)
        extra = [(b"x-request-id", rid.encode("latin-1")), (b"x-steadyserve-fingerprint", self.fingerprint)]
        access = self._access(scope)
        bound = bind(access.tenant)
        trace = self._trace(scope, headers)
        try:
            if trace is not None:
                try:
                    return await self._serve(scope, receive, send, headers, extra, trace, access)
                finally:
                    attrs: dict[str, Any] = {}
                    if scope["type"] == "http":
                        attrs["http.route"] = _route(scope)
                        if trace.status is not None:
                            attrs["http.response.status_code"] = trace.status
                    trace.ended(trace_end(scope, trace.status), **attrs)
            return await self._serve(scope, receive, send, headers, extra, None, access)
        finally:
            unbind(bound)

    def _trace(self, scope: dict, headers: dict) -> RequestTrace | None:
        """Open the request's trace record when tracing is on and this is an inference route."""
        tracing = self.state.tracing
        path = scope.get("path", "")
        if tracing is None or not path.startswith("/v1/") or path.startswith("/v1/console"):
            return None
        if scope["type"] == "http" and scope.get("method") != "POST":
            return None
        carrier = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers.items()}
        transport = "ws" if scope["type"] == "websocket" else "http"
        return tracing.begin(transport, ROUTE_OPERATIONS.get(path, path), carrier,
                             **{"http.request.method": scope.get("method", "GET"), "url.path": path})

    def _count_refusal(self, access: Access) -> None:
        m = self.state.metrics
        if m is not None and access.refusal is not None:
            m.rejected.labels(access.refusal).inc()
            if access.tenant is not None:
                m.on_tenant_refused(access.tenant.name, access.refusal)

    async def _serve(self, scope: dict, receive: Any, send: Any, headers: dict, extra: list,
                     trace: RequestTrace | None, access: Access) -> None:
        if scope["type"] == "websocket":
            if access.refusal is not None:
                self._count_refusal(access)
                await receive()
                if trace is not None:
                    trace.status = 1008
                await send({"type": "websocket.close", "code": 1008, "reason": access.message[:120]})
                return

            offered = [p.strip() for p in headers.get(b"sec-websocket-protocol", b"").decode("latin-1").split(",")]
            bearer = next((p for p in offered if p.startswith("bearer.")), None)

            async def ws_send(message: dict) -> None:  # the handshake response carries the headers too
                if trace is not None and message["type"] == "websocket.close":
                    trace.status = message.get("code", 1000)
                if message["type"] == "websocket.accept":
                    message = {**message, "headers": list(message.get("headers") or []) + extra}
                    if bearer and not message.get("subprotocol"):  # a browser fails a handshake that drops it
                        message["subprotocol"] = bearer
                await send(message)

            return await self.app(scope, receive, ws_send)
        t0 = time.perf_counter()
        status = [500]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if trace is not None:
                    trace.status = status[0]
                message = {**message, "headers": list(message.get("headers", [])) + extra}
            await send(message)

        try:
            if access.refusal is not None:
                self._count_refusal(access)
                messages = is_messages_path(scope.get("path", ""))
                if access.refusal == "forbidden":
                    resp = anthropic_error(403, access.message) if messages else \
                        error_response(403, access.message, "permission_error", None, "forbidden")
                else:
                    why = "missing or invalid API key (Authorization: Bearer ... or x-api-key)"
                    resp = anthropic_error(401, why) if messages else \
                        error_response(401, why, "authentication_error", None, "invalid_api_key")
                return await resp(scope, receive, send_wrapper)
            length = headers.get(b"content-length")
            limit = self.state.config.server.max_request_bytes
            if length is not None and length.isdigit() and int(length) > limit:
                why = f"request body exceeds {limit} bytes (--max-request-bytes)"
                resp = anthropic_error(413, why) if is_messages_path(scope.get("path", "")) else \
                    error_response(413, why, "invalid_request_error", None, "request_too_large")
                return await resp(scope, receive, send_wrapper)
            await self.app(scope, receive, send_wrapper)
        finally:
            m = self.state.metrics
            if m is not None:
                route = _route(scope)
                m.http_requests.labels(scope.get("method", ""), route, str(status[0])).inc()
                m.http_seconds.labels(scope.get("method", ""), route).observe(time.perf_counter() - t0)
