"""The Ingress deployment: Ray Serve's HTTP and gRPC proxies reach steadyserve through it.

It runs no model code: every request goes through Ray's router (a DeploymentHandle) to an
EngineReplica and comes back as it was produced there. What it adds is what a proxy in front of
several replicas must say itself, in the server's own error shapes:

- overload: Ray's router refuses a request beyond max_queued_requests (BackPressureError), answered
  429 + Retry-After / RESOURCE_EXHAUSTED + retry-after-ms, never queued without bound;
- a replica lost before answering (killed, crashed): one retry on another replica, else 503 / UNAVAILABLE;
- a replica lost mid-stream: the stream ends with an explicit error event (SSE), error frame and close
  1011 (WebSocket) or UNAVAILABLE (gRPC), code `replica_lost`; never a silently short stream;
- tenants (--api-keys): each held to its weighted share of the whole deployment once it is nearly full, and to its
  max_concurrent across replicas (shares.py), so one tenant's flood cannot fill Ray's shared queue; refused with
  the tenant's own 429 `tenant_share` / `tenant_concurrency`, as a replica would answer.
"""

# No `from __future__ import annotations` here: FastAPI reads the route handlers' annotations at run time
# (Request, WebSocket), and Ray's class-based ingress wraps them where string annotations do not resolve.

import json
import logging
import math
from typing import Any, AsyncIterator

import grpc
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.websockets import WebSocketDisconnect

from ..api.grpc import ERROR_CODE_KEY, PUSHBACK_KEY, RETRY_AFTER_KEY
from ..api.http.errors import error_body, refusal_response
from ..api.tenancy import grpc_key, http_key
from ..limits import RATE_REASONS, Refused
from ..api.protos.steadyserve.v1.inference_pb2 import GenerateResponse
from .shares import UNCOUNTED, Ticket, ingress_shares

log = logging.getLogger("steadyserve.ray")

RETRY_AFTER_S = 1  # what a refused client is told to wait: Ray's queue turns over within a request's time
_LOST = "the replica serving this request stopped before it finished ({why}); retry the request"
_RAY_METADATA = {"application", "multiplexed_model_id", "request_id", "user-agent", "content-type", "te"}

app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)


def _error_json(message: str, type_: str, code: str) -> bytes:
    """The server's own error body (api/http/errors.py), as bytes."""
    return json.dumps(error_body(message, type_, None, code)).encode()


def _overloaded(e: Exception) -> Response:
    return Response(_error_json(f"all replicas are busy and Ray's queue is full ({e}); retry later", "overloaded",
                                "overloaded"), status_code=429, media_type="application/json",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


_DONE = b"data: [DONE]\n\n"  # the last event of every OpenAI-style stream


def _lost(why: str) -> Response:
    return Response(_error_json(_LOST.format(why=why), "unavailable", "replica_lost"), status_code=503,
                    media_type="application/json", headers={"Retry-After": str(RETRY_AFTER_S)})


class CallEnded(Exception):
    """Ends a streamed gRPC call with the code already set on its context (Ray's proxy reads it)."""


class _Raw:
    """A response message already serialized by the replica's server: Ray's replica calls
    SerializeToString() on what a gRPC method returns, so the bytes pass through untouched."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return self.data


def _metadata(grpc_context: Any) -> list[tuple[str, str]]:
    """The client's metadata, less what Ray's proxy and gRPC itself set."""
    return [(k, v) for k, v in grpc_context.invocation_metadata()
            if k not in _RAY_METADATA and not k.startswith((":", "grpc-")) and isinstance(v, str)]


def _set_status(grpc_context: Any, status: dict[str, Any]) -> None:
    grpc_context.set_trailing_metadata(status["trailers"])
    code = next(c for c in grpc.StatusCode if c.value[0] == status["code"])
    if code != grpc.StatusCode.OK:
        grpc_context.set_code(code)
        grpc_context.set_details(status["details"])


def _grpc_refusal(grpc_context: Any, e: Exception) -> None:
    if isinstance(e, Refused):  # a tenant's own limit (shares.py): the replica's own answer to it
        ms = str(max(1, math.ceil((e.retry_after or 1.0) * 1000)))
        grpc_context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED if e.reason in RATE_REASONS
                              else grpc.StatusCode.UNAVAILABLE)
        grpc_context.set_details(str(e))
        grpc_context.set_trailing_metadata([(ERROR_CODE_KEY, e.reason), (RETRY_AFTER_KEY, ms), (PUSHBACK_KEY, ms)])
    elif isinstance(e, BackPressureError):
        ms = str(RETRY_AFTER_S * 1000)
        grpc_context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        grpc_context.set_details(f"all replicas are busy and Ray's queue is full ({e}); retry later")
        grpc_context.set_trailing_metadata([(ERROR_CODE_KEY, "overloaded"), (RETRY_AFTER_KEY, ms), (PUSHBACK_KEY, ms)])
    else:
        grpc_context.set_code(grpc.StatusCode.UNAVAILABLE)
        grpc_context.set_details(_LOST.format(why=type(e).__name__))
        grpc_context.set_trailing_metadata([(ERROR_CODE_KEY, "replica_lost")])


async def relay_events(stream: Any, ticket: Ticket = UNCOUNTED) -> AsyncIterator[bytes]:
    """The body of a server-sent-events response, relayed whole-event by whole-event; a replica lost
    mid-stream ends it with an error event and [DONE]. One lost after its [DONE] was relayed (the replica
    died before Ray saw its generator end) has nothing to add: the client already has the whole stream, and
    SSE clients ignore what follows [DONE]."""
    finished = complete = False
    try:
        async for chunk in stream:
            yield chunk
            complete = chunk.endswith(_DONE)
        finished = True
    except Exception as e:
        finished = True
        if complete:
            log.info("replica lost after its stream's [DONE]", extra={"fields": {"error": repr(e)}})
            return
        log.warning("replica lost mid-stream; ending the stream with an error event",
                    extra={"fields": {"error": repr(e)}})
        yield b"data: " + _error_json(_LOST.format(why=type(e).__name__), "server_error", "replica_lost") \
            + b"\n\n" + _DONE
    finally:
        ticket.close()
        if not finished:  # the client went away: stop the request on the replica
            stream.cancel()


# serve.ingress copies the class when it is decorated: everything its methods use is defined above it.
@serve.ingress(app)
class Ingress:
    def __init__(self, engine: Any, max_request_bytes: int, keys_file: str = "", capacity: int = 0) -> None:
        self.engine = engine.options(stream=True)  # DeploymentHandle to EngineReplica, streaming calls
        self.max_request_bytes = max_request_bytes
        self.shares = ingress_shares(keys_file, capacity)  # None without --api-keys

    def _admit(self, key: str) -> Ticket:
        """The request's hold on its tenant's count, or Refused (its own limit)."""
        return self.shares.admit(key) if self.shares is not None else UNCOUNTED

    async def _open(self, method: str, *args: Any) -> tuple[Any, Any]:
        """Start a streaming call and take its first item. A replica lost before it produced anything is
        retried once (nothing reached the client yet); Ray's router picks another replica."""
        for attempt in (1, 2):
            stream = getattr(self.engine, method).remote(*args)
            try:
                return stream, await stream.__anext__()  # BackPressureError, replica loss
            except BackPressureError:
                raise
            except Exception as e:  # RayActorError, ActorDiedError, ActorUnavailableError, ...
                if attempt == 2:
                    raise
                log.warning("replica lost before answering; retrying once", extra={"fields": {"error": repr(e)}})
        raise AssertionError("unreachable")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def forward(self, path: str, request: Request) -> Response:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_request_bytes:
                return Response(_error_json(f"request body exceeds {self.max_request_bytes} bytes "
                                            "(--max-request-bytes)", "invalid_request_error", "request_too_large"),
                                status_code=413, media_type="application/json")
        try:
            ticket = self._admit(http_key(dict(request.headers.raw), websocket=False))
        except Refused as e:
            return refusal_response(e)
        relayed = False  # the stream's body releases the ticket once it has been relayed
        try:
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
            try:
                stream, head = await self._open("http_request", request.method, "/" + path, request.url.query,
                                                headers, body)
            except BackPressureError as e:
                return _overloaded(e)
            except Exception as e:
                return _lost(type(e).__name__)
            status, out = head["status"], head["headers"]
            media = next((v for k, v in out if k.lower() == "content-type"), "")
            if media.startswith("text/event-stream"):
                events = relay_events(stream, ticket)
                ticket.close_with(events)
                relayed = True
                return StreamingResponse(events, status_code=status, headers=dict(out))
            try:  # a whole JSON body is small: collect it, so a replica lost halfway still gets a clean 503
                content = b"".join([chunk async for chunk in stream])
            except Exception as e:
                return _lost(type(e).__name__)
            return Response(content, status_code=status, headers=dict(out))
        finally:
            if not relayed:
                ticket.close()

    @app.websocket("/{path:path}")
    async def forward_ws(self, path: str, ws: WebSocket) -> None:
        protocols = [p.strip() for p in ws.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        await ws.accept(subprotocol=protocols[0] if protocols else None)
        try:
            first = await ws.receive()
        except WebSocketDisconnect:
            return
        if first["type"] == "websocket.disconnect":
            return
        try:
            ticket = self._admit(http_key(dict(ws.headers.raw), websocket=True))
        except Refused as e:
            return await self._ws_fail(ws, 1013, str(e), "rate_limit_error", e.reason)
        try:
            await self._ws_session(ws, path, first)
        finally:
            ticket.close()

    async def _ws_session(self, ws: WebSocket, path: str, first: dict[str, Any]) -> None:
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in ws.headers.raw]
        try:
            stream, item = await self._open("websocket_session", "/" + path, ws.url.query, headers,
                                            {"text": first.get("text"), "bytes": first.get("bytes")})
        except BackPressureError as e:
            return await self._ws_fail(ws, 1013, f"all replicas are busy and Ray's queue is full ({e}); retry "
                                       "later", "overloaded", "overloaded")
        except Exception as e:
            return await self._ws_fail(ws, 1011, _LOST.format(why=type(e).__name__), "unavailable", "replica_lost")
        try:
            while "close" not in item:
                await (ws.send_text(item["text"]) if "text" in item else ws.send_bytes(item["bytes"]))
                item = await stream.__anext__()
            await ws.close(item["close"], item["reason"])
        except (WebSocketDisconnect, RuntimeError, OSError):
            stream.cancel()  # the client went away
        except StopAsyncIteration:
            await ws.close(1000)
        except Exception as e:
            await self._ws_fail(ws, 1011, _LOST.format(why=type(e).__name__), "server_error", "replica_lost")

    @staticmethod
    async def _ws_fail(ws: WebSocket, close: int, message: str, type_: str, code: str) -> None:
        try:
            await ws.send_text(json.dumps({"type": "error", **error_body(message, type_, None, code)}))
            await ws.close(close)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass

    # gRPC: Ray Serve's gRPC proxy calls the method named as the RPC, with the parsed request.

    async def Score(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("Score", request, grpc_context)

    async def GetModelInfo(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("GetModelInfo", request, grpc_context)

    async def Tokenize(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("Tokenize", request, grpc_context)

    async def Generate(self, request: Any, grpc_context: Any) -> AsyncIterator[Any]:
        # Ray's proxy copies grpc_context onto the call only as a message goes out, and turns a raised
        # exception into the code set here (without trailers). So the stream's `final` message is held
        # back until the server's status has arrived: status and trailers (the fingerprint) ride on it.
        held, stream, done, ticket = None, None, False, UNCOUNTED
        try:
            ticket = self._admit(grpc_key(grpc_context.invocation_metadata()))
            stream, item = await self._open("grpc_call", "Generate", request.SerializeToString(),
                                            _metadata(grpc_context), True)
            while isinstance(item, bytes):
                if GenerateResponse.FromString(item).HasField("final"):
                    held = item
                else:
                    yield _Raw(item)
                item = await stream.__anext__()
            done = True
        except Exception as e:
            done = True
            _grpc_refusal(grpc_context, e)
            raise CallEnded(grpc_context.details()) from None
        finally:
            ticket.close()
            if stream is not None and not done:  # the client cancelled: stop the request on the replica
                stream.cancel()
        _set_status(grpc_context, item)
        if held is not None:
            yield _Raw(held)
        elif item["code"] != grpc.StatusCode.OK.value[0]:
            raise CallEnded(item["details"])

    async def _unary(self, method: str, request: Any, grpc_context: Any) -> Any:
        ticket = UNCOUNTED
        try:
            ticket = self._admit(grpc_key(grpc_context.invocation_metadata()))
            stream, item = await self._open("grpc_call", method, request.SerializeToString(),
                                            _metadata(grpc_context), False)
            status = item if isinstance(item, dict) else await stream.__anext__()
        except Exception as e:
            _grpc_refusal(grpc_context, e)
            return _Raw(b"")
        finally:
            ticket.close()
        _set_status(grpc_context, status)
        return _Raw(item if isinstance(item, bytes) else b"")
