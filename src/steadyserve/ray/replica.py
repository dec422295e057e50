"""EngineReplica: the Ray Serve deployment that owns one engine (a `steadyserve serve` child).

Requests reach it only through Ray's router (the Ingress deployment's handle), so Ray counts its
ongoing requests for autoscaling and bounds them with max_ongoing_requests / max_queued_requests.
Each method forwards one request to the child over loopback and streams the answer back in pieces
Ray can carry: HTTP (a head, then body chunks; server-sent events whole, never split mid-event), a
WebSocket session (frames, then the close), and a gRPC call (messages, then the status).

Shutdown: Ray stops routing to a replica it scales down, waits for its ongoing requests
(graceful_shutdown_timeout_s, set from --drain-timeout), then calls __del__, which SIGTERMs the child:
the server drains whatever is left exactly as `steadyserve serve` does.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import grpc
import httpx
import websockets

from ..api.grpc import SERVICE
from ..api.protos.steadyserve.v1.inference_pb2 import GenerateResponse
from ..limits import POOLED_IDLE_S
from .child import ChildServer

log = logging.getLogger("steadyserve.ray")

REPLICA_HEADER = "x-steadyserve-replica"  # HTTP response header and gRPC trailer: which replica served
# Hop-by-hop and per-connection headers: each side of the forwarding sets its own.
_DROP_REQUEST = {"host", "content-length", "connection", "transfer-encoding", "keep-alive", "upgrade"}
# x-request-id too: Ray's proxy sets it (the client's own id when it sent one, as the server does).
_DROP_RESPONSE = {"content-length", "connection", "transfer-encoding", "keep-alive", "date", "server", "x-request-id"}


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Ray replica (unit tests of the forwarding)
        return "local"


def child_client(url: str) -> httpx.AsyncClient:
    """The replica's HTTP client to its child server. No timeouts: the child bounds every request itself (stall
    and drain timeouts, deadlines). Idle connections are dropped after POOLED_IDLE_S, before the server's own
    keep-alive timeout closes them under a request."""
    return httpx.AsyncClient(base_url=url, timeout=None,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                 keepalive_expiry=POOLED_IDLE_S))


class EngineReplica:
    """One engine: its child server, and the forwarding of HTTP, WebSocket and gRPC calls to it."""

    def __init__(self, serve_args: list[str], drain_timeout: float) -> None:
        # Started here, on the thread Ray runs the constructor on, which lives as long as the replica:
        # the child's parent-death signal follows the thread that forked it.
        self.child = ChildServer(serve_args)
        self.address = self.child.start()
        self.drain_timeout = drain_timeout
        self.replica_id = _replica_id()
        self._http: httpx.AsyncClient | None = None  # made on first use, on the event loop that uses it
        self._channel: grpc.aio.Channel | None = None
        log.info("replica serving", extra={"fields": {"replica": self.replica_id, "child_pid": self.address.pid,
                                                      "http": self.address.http_url}})

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = child_client(self.address.http_url)
        return self._http

    async def http_request(self, method: str, path: str, query: str, headers: list[tuple[str, str]],
                           body: bytes) -> AsyncIterator[dict | bytes]:
        """Yields {"status", "headers"} first, then the body in chunks; a text/event-stream body in whole
        events, so that a stream cut between chunks never leaves half an event for the ingress to end."""
        url = path + ("?" + query if query else "")
        sent = [(k, v) for k, v in headers if k.lower() not in _DROP_REQUEST]
        async with self._client().stream(method, url, headers=sent, content=body) as r:
            out = [(k, v) for k, v in r.headers.multi_items() if k.lower() not in _DROP_RESPONSE]
            yield {"status": r.status_code, "headers": out + [(REPLICA_HEADER, self.replica_id)]}
            if not r.headers.get("content-type", "").startswith("text/event-stream"):
                async for chunk in r.aiter_raw():
                    yield chunk
                return
            pending = b""
            async for chunk in r.aiter_raw():
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end >= 0:
                    yield pending[:end + 2]
                    pending = pending[end + 2:]
            if pending:
                yield pending

    async def websocket_session(self, path: str, query: str, headers: list[tuple[str, str]],
                                first: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Opens the child's WebSocket, sends the client's request frame, yields {"text"|"bytes": ...} per
        frame the server sends, then {"close": code, "reason": ...}."""
        url = self.address.http_url.replace("http://", "ws://", 1) + path + ("?" + query if query else "")
        keep = {"authorization", "x-api-key", "x-request-id", "sec-websocket-protocol"}  # the tenant key
        sent = [(k, v) for k, v in headers if k.lower() in keep and k.lower() != "sec-websocket-protocol"]
        protocols = [p.strip() for k, v in headers if k.lower() == "sec-websocket-protocol" for p in v.split(",")]
        async with websockets.connect(url, additional_headers=sent, subprotocols=protocols or None,
                                      max_size=None, open_timeout=30) as ws:
            await ws.send(first["text"] if first.get("text") is not None else first.get("bytes") or b"")
            try:
                async for frame in ws:
                    yield {"text": frame} if isinstance(frame, str) else {"bytes": frame}
            except websockets.ConnectionClosed:
                pass
            yield {"close": ws.close_code or 1000, "reason": ws.close_reason or ""}

    def _grpc(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address.grpc_target, options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024)])
        return self._channel

    async def grpc_call(self, method: str, request: bytes, metadata: list[tuple[str, str]],
                        streaming: bool) -> AsyncIterator[bytes | dict[str, Any]]:
        """Calls steadyserve.v1.Inference/`method` with the serialized request; yields each response message
        (serialized), then {"code": grpc status code number, "details", "trailers"}. A streaming call's token
        batches that arrived while the previous item was being handed to Ray go as one (merge_batches)."""
        path = f"/{SERVICE}/{method}"
        channel = self._grpc()
        call: Any = (channel.unary_stream(path) if streaming else channel.unary_unary(path))(
            request, metadata=tuple(metadata))
        try:
            if streaming:
                async for messages in _arrived(call):
                    for message in merge_batches(messages):
                        yield message
            else:
                yield await call
            code, details, trailers = await call.code(), await call.details(), await call.trailing_metadata()
        except grpc.aio.AioRpcError as e:
            code, details, trailers = e.code(), e.details(), e.trailing_metadata()
        yield {"code": code.value[0], "details": details or "",
               "trailers": [(k, v) for k, v in (trailers or ()) if isinstance(v, str)]
               + [(REPLICA_HEADER, self.replica_id)]}

    async def check_health(self) -> None:
        """Ray's health check: the child must be alive and answer liveness. Not readiness: a child that
        drains is still healthy (Ray would otherwise kill it mid-drain); Ray stops routing to a replica it
        shuts down before the drain begins."""
        if not self.child.alive:
            raise RuntimeError(f"steadyserve serve exited with {self.child.proc.returncode if self.child.proc else '?'}"
                               f":\n{self.child.log_tail(2000)}")
        r = await self._client().get("/healthz", timeout=10)
        if r.status_code != 200:
            raise RuntimeError(f"steadyserve serve liveness answered {r.status_code}")

    def __del__(self) -> None:
        child = getattr(self, "child", None)
        if child is None:
            return
        code = child.drain(self.drain_timeout + 10)
        log.info("replica stopped", extra={"fields": {"replica": getattr(self, "replica_id", "?"), "exit_code": code}})
        child.cleanup()


async def _arrived(call: Any) -> AsyncIterator[list[bytes]]:
    """The messages of a server-streaming call, in the groups they arrived in: each group is what was waiting
    when the consumer came back, at least one message. Every yield is a Ray object sent to the ingress (and
    another on to Ray's proxy), which under load costs far more than a step of a small model: without the
    groups, a replica short of CPU fell minutes behind its engine, one Ray object per token, with nothing
    refused. Quiet, each group is one message and nothing waits. Raises the call's AioRpcError at its place."""
    queue: asyncio.Queue = asyncio.Queue()  # bounded by the child's stream: one request's messages

    async def read() -> None:
        try:
            async for message in call:
                queue.put_nowait(message)
            queue.put_nowait(None)
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, raised there)
            queue.put_nowait(e)

    reader = asyncio.create_task(read())
    try:
        while True:
            group = [await queue.get()]
            while not queue.empty():
                group.append(queue.get_nowait())
            end = group[-1]
            messages = [m for m in group if isinstance(m, bytes)]
            if messages:
                yield messages
            if end is None:
                return
            if isinstance(end, BaseException):
                raise end
    finally:
        if not reader.done():  # the consumer left (the client cancelled): stop reading and the call
            reader.cancel()
            call.cancel()


def merge_batches(messages: list[bytes]) -> list[bytes]:
    """Consecutive GenerateResponse token batches as one: token ids and logprobs appended, texts concatenated,
    which is what a client assembles from them anyway (TokenBatch: the texts of all batches concatenate to the
    output). Anything else (the final message) stays a message of its own, in its place."""
    if len(messages) == 1:
        return messages  # nothing to merge: the bytes as they came, unparsed
    out: list[bytes] = []
    merged: GenerateResponse | None = None
    for raw in messages:
        msg = GenerateResponse.FromString(raw)
        if msg.HasField("batch"):
            if merged is None:
                merged = msg
            else:
                merged.batch.token_ids.extend(msg.batch.token_ids)
                merged.batch.text += msg.batch.text
                merged.batch.logprobs.extend(msg.batch.logprobs)
            continue
        if merged is not None:
            out.append(merged.SerializeToString())
            merged = None
        out.append(raw)
    if merged is not None:
        out.append(merged.SerializeToString())
    return out
