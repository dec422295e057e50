"""One server interceptor for every RPC: the tenant gate (api/tenancy.py), fingerprint trailer, and the
grpc_server_* metrics.

The metrics follow go-grpc-prometheus: started, handled by status code, and
handling time, labelled with grpc_type (unary, server_stream, ...), service
and method. The code is read from the RPC's own outcome, so an abort, a
deadline or a client cancel is counted as what the client saw.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import Any, Awaitable, Callable

import grpc

from ..state import ServerState
from ..tenancy import OPEN_SERVICES, Access, bind, unbind
from ..tracing import RequestTrace
from . import ERROR_CODE_KEY, FINGERPRINT_KEY
from .servicer import deadline_passed

log = logging.getLogger("steadyserve.grpc")


# The RPCs a trace is recorded for, and their gen_ai.operation.name before the request is parsed.
TRACED_RPCS = {"Generate": "text_completion", "Score": "score", "Embed": "embeddings"}

_KINDS = (  # (handler attribute, grpc_type label, factory)
    ("unary_unary", "unary", grpc.unary_unary_rpc_method_handler),
    ("unary_stream", "server_stream", grpc.unary_stream_rpc_method_handler),
    ("stream_unary", "client_stream", grpc.stream_unary_rpc_method_handler),
    ("stream_stream", "bidi_stream", grpc.stream_stream_rpc_method_handler),
)


def _code_name(context: grpc.aio.ServicerContext, exc: BaseException | None) -> str:
    """The status the client sees, as go-grpc-prometheus spells it (OK, INVALID_ARGUMENT, ...)."""
    if isinstance(exc, asyncio.CancelledError) or context.cancelled():
        return "DEADLINE_EXCEEDED" if deadline_passed(context) else "CANCELLED"
    code = context.code()
    if code is None:
        return "UNKNOWN" if exc is not None and not isinstance(exc, grpc.aio.AbortError) else "OK"
    if isinstance(code, grpc.StatusCode):
        return code.name
    return next((c.name for c in grpc.StatusCode if c.value[0] == code), str(code))


def _code_value(name: str) -> int:
    """The numeric status code of a code name (rpc.grpc.status_code); 2 (UNKNOWN) for one gRPC does not name."""
    return next((c.value[0] for c in grpc.StatusCode if c.name == name), 2)


def _details(context: grpc.aio.ServicerContext) -> str:
    try:
        return context.details() or ""
    except Exception:  # not every context keeps them
        return ""


class ServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.fingerprint = str(state.fingerprint)

    def _access(self, details: grpc.HandlerCallDetails, service: str, method: str) -> Access:
        return self.state.gate.grpc(service, method, details.invocation_metadata)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return None
        service, _, method = details.method.lstrip("/").rpartition("/")
        access = self._access(details, service, method)
        for attr, grpc_type, factory in _KINDS:
            behavior = getattr(handler, attr)
            if behavior is not None:
                wrapped = self._wrap(behavior, (grpc_type, service, method), access, details)
                deserializer = handler.request_deserializer
                if deserializer is not None and attr in ("unary_unary", "unary_stream"):
                    deserializer = _tolerant(deserializer)
                return factory(wrapped, request_deserializer=deserializer,
                               response_serializer=handler.response_serializer)
        return handler

    def _trace(self, labels: tuple[str, str, str], details: grpc.HandlerCallDetails) -> RequestTrace | None:
        """Open the RPC's trace record when tracing is on and it is an inference RPC; it joins the trace of the
        caller's traceparent metadata."""
        tracing = self.state.tracing
        operation = TRACED_RPCS.get(labels[2])
        if tracing is None or operation is None or labels[1] in OPEN_SERVICES:
            return None
        carrier = {k.lower(): v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        return tracing.begin("grpc", operation, carrier, **{"rpc.system": "grpc", "rpc.service": labels[1],
                                                             "rpc.method": labels[2]})

    def _wrap(self, behavior: Callable, labels: tuple[str, str, str], access: Access,
              details: grpc.HandlerCallDetails) -> Callable:
        metrics = self.state.metrics
        trailer = ((FINGERPRINT_KEY, self.fingerprint),)
        trace: list[RequestTrace | None] = [None]

        def begin(context: grpc.aio.ServicerContext) -> float:
            if metrics is not None:
                metrics.grpc_started.labels(*labels).inc()
            context.set_trailing_metadata(trailer)
            trace[0] = self._trace(labels, details)
            return time.perf_counter()

        async def malformed(context: grpc.aio.ServicerContext, request: "_Malformed") -> None:
            if metrics is not None:
                metrics.rejected.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid protobuf message for {labels[2]}: {request.why}",
                                trailer + ((ERROR_CODE_KEY, "invalid"),))

        async def refuse(context: grpc.aio.ServicerContext) -> None:
            reason = access.refusal or "unauthenticated"
            if metrics is not None:
                metrics.rejected.labels(reason).inc()
                if access.tenant is not None:
                    metrics.on_tenant_refused(access.tenant.name, reason)
            if reason == "forbidden":
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, access.message,
                                    trailer + ((ERROR_CODE_KEY, "forbidden"),))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key (metadata authorization: Bearer ...)", trailer)

        def end(context: grpc.aio.ServicerContext, t0: float, exc: BaseException | None) -> None:
            if exc is not None and not isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError)) \
                    and not context.cancelled():
                log.error("rpc failed", exc_info=exc, extra={"fields": {"method": labels[2]}})
            code = _code_name(context, exc)
            if metrics is not None:
                metrics.grpc_handled.labels(*labels, code).inc()
                metrics.grpc_seconds.labels(*labels).observe(time.perf_counter() - t0)
            if trace[0] is not None:
                details_text = _details(context)
                trace[0].ended(None if code == "OK" else (code, details_text or code), **{"rpc.grpc.status_code":
                                                                                          _code_value(code)})

        async def admit(request: Any, context: grpc.aio.ServicerContext) -> None:
            """Abort before the handler runs: no key, or a message that did not decode."""
            if access.refusal is not None:
                await refuse(context)
            if isinstance(request, _Malformed):
                await malformed(context, request)

        if inspect.isasyncgenfunction(behavior):  # a streaming handler written as an async generator
            async def stream_wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
                t0, exc, bound = begin(context), None, bind(access.tenant)
                try:
                    await admit(request, context)
                    async for item in behavior(request, context):
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    unbind(bound)
                    end(context, t0, exc)
            return stream_wrapper

        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0, exc, bound = begin(context), None, bind(access.tenant)
            try:
                await admit(request, context)
                return await behavior(request, context)
            except BaseException as e:
                exc = e
                raise
            finally:
                unbind(bound)
                end(context, t0, exc)
        return wrapper


class _Malformed:
    """A request whose bytes did not parse; the handler wrapper answers INVALID_ARGUMENT (gRPC would say UNKNOWN)."""

    def __init__(self, why: str) -> None:
        self.why = why


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # DecodeError, invalid UTF-8 in a string field, ...
            return _Malformed(f"{type(e).__name__}: {e}"[:200])
    return deserialize
