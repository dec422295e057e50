"""Typed gRPC clients for steadyserve: `Client` (blocking) and `AsyncClient` (asyncio).

    from steadyserve.client import Client
    with Client(["10.0.0.1:50051", "10.0.0.2:50051"], api_key="...") as c:
        r = c.score("The cat sat on the mat", top_logprobs=5)
        for msg in c.generate("Once upon a time", max_tokens=32, temperature=0):
            ...

Both balance over the given addresses with gRPC's round_robin policy (one
connection per replica, calls spread over the ready ones) and carry a
service config whose retry policy retries RESOURCE_EXHAUSTED (a replica at
capacity; gRPC waits the server's `grpc-retry-pushback-ms`) and UNAVAILABLE
(a replica draining or gone; the retry goes to the next replica). Both codes
mean the request was never started, so retrying is safe even for Generate.
Responses are the generated protobuf messages (steadyserve.v1); errors are
grpc.RpcError with the server's trailing metadata (see `retry_after_ms`).
"""

from __future__ import annotations

import ipaddress
import json
import socket
import struct
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .api.grpc import FINGERPRINT_KEY, RETRY_AFTER_KEY, SERVICE
from .api.protos.steadyserve.v1 import inference_pb2 as pb
from .api.protos.steadyserve.v1 import inference_pb2_grpc as pb_grpc

__all__ = ["Client", "AsyncClient", "pb", "channel_target", "service_config", "logprobs_f32", "retry_after_ms",
           "fingerprint_of"]

RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"],
}
MAX_RECEIVE_BYTES = 64 * 1024 * 1024  # the server's send limit


def service_config(retries: bool = True, health_check: bool = False) -> str:
    """The channel's default service config: round_robin, and the retry policy for Inference calls.

    `health_check`: gRPC client-side health checking (a Watch on grpc.health.v1 per replica), so that
    round_robin stops picking a replica the moment it reports NOT_SERVING (draining), before its port
    closes. Only useful with several replicas: with one, every call would fail in the client instead of
    getting the server's own refusal (UNAVAILABLE with `steadyserve-error-code: draining`).
    """
    method: dict[str, Any] = {"name": [{"service": SERVICE}]}
    if retries:
        method["retryPolicy"] = RETRY_POLICY
    cfg: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}], "methodConfig": [method]}
    if health_check:
        cfg["healthCheckConfig"] = {"serviceName": ""}
    return json.dumps(cfg)


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r} must be host:port")
    return host.strip("[]"), int(port)


def channel_target(addresses: str | Sequence[str]) -> str:
    """A gRPC target naming every replica, so that round_robin can balance over them.

    One address: used as given (any gRPC target works, e.g. dns:///svc:50051). Several: IP
    literals become an ipv4:/ipv6: list; host names are resolved once, now.
    """
    if isinstance(addresses, str):
        addresses = [addresses]
    if not addresses:
        raise ValueError("at least one address is needed")
    if len(addresses) == 1:
        return addresses[0]
    hosts: list[tuple[str, int]] = []
    for a in addresses:
        host, port = _split(a)
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
        hosts.append((str(ip), port))
    versions = {ipaddress.ip_address(h).version for h, _ in hosts}
    if versions == {4}:
        return "ipv4:" + ",".join(f"{h}:{p}" for h, p in hosts)
    if versions == {6}:
        return "ipv6:" + ",".join(f"[{h}]:{p}" for h, p in hosts)
    raise ValueError("cannot mix IPv4 and IPv6 replicas in one channel")


def channel_options(retries: bool = True, health_check: bool = False) -> list[tuple[str, Any]]:
    return [
        ("grpc.service_config", service_config(retries, health_check)),
        ("grpc.enable_retries", 1 if retries else 0),
        ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ("grpc.keepalive_time_ms", 30_000),  # the server accepts pings every 10 s or slower
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def logprobs_f32(resp: pb.ScoreResponse) -> bytes:
    """The scored tokens' logprobs (all but the first token) as little-endian float32 bytes: compare these."""
    values = [t.logprob for t in resp.tokens[1:]]
    return struct.pack(f"<{len(values)}f", *values)


def retry_after_ms(err: grpc.RpcError) -> int | None:
    """The server's retry hint on RESOURCE_EXHAUSTED / UNAVAILABLE, in milliseconds."""
    value = dict(err.trailing_metadata() or ()).get(RETRY_AFTER_KEY)  # type: ignore[attr-defined]
    return int(value) if value is not None else None


def fingerprint_of(call: Any) -> str | None:
    """The fingerprint from a call's (or an RpcError's) trailing metadata."""
    return dict(call.trailing_metadata() or ()).get(FINGERPRINT_KEY)


def _prompt(msg: Any, text: str | None, token_ids: Sequence[int] | None,
            messages: Sequence[dict[str, str]] | None = None) -> None:
    given = [x is not None for x in (text, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of text, token_ids, messages")
    if text is not None:
        msg.text = text
    elif token_ids is not None:
        msg.tokens.ids.extend(token_ids)
    else:
        msg.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ())


def score_request(text: str | None = None, *, token_ids: Sequence[int] | None = None, top_logprobs: int = 0,
                  model: str = "", request_id: str = "", receipt: bool = False) -> pb.ScoreRequest:
    msg = pb.ScoreRequest(top_logprobs=top_logprobs, model=model, request_id=request_id, receipt=receipt)
    _prompt(msg, text, token_ids)
    return msg


def generate_request(text: str | None = None, *, token_ids: Sequence[int] | None = None,
                     messages: Sequence[dict[str, str]] | None = None, max_tokens: int | None = None,
                     temperature: float | None = None, top_p: float | None = None, top_k: int = 0,
                     seed: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                     ignore_eos: bool = False, logprobs: int | None = None, model: str = "",
                     request_id: str = "", receipt: bool = False) -> pb.GenerateRequest:
    params = pb.SamplingParameters(top_k=top_k, stop=list(stop), stop_token_ids=list(stop_token_ids),
                                   ignore_eos=ignore_eos)
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("seed", seed), ("logprobs", logprobs)):
        if value is not None:  # unset fields take the server's defaults
            setattr(params, name, value)
    msg = pb.GenerateRequest(params=params, model=model, request_id=request_id, receipt=receipt)
    _prompt(msg, text, token_ids, messages)
    return msg


def tokenize_request(text: str | None = None, *, messages: Sequence[dict[str, str]] | None = None
                     ) -> pb.TokenizeRequest:
    msg = pb.TokenizeRequest()
    _prompt(msg, text, None, messages)
    return msg


def embed_request(inputs: Sequence[str | Sequence[int]], *, dimensions: int = 0, model: str = "",
                  request_id: str = "") -> pb.EmbedRequest:
    """Embed's message: each input a text or a token-id list."""
    items = [pb.EmbedInput(text=x) if isinstance(x, str) else pb.EmbedInput(tokens=pb.TokenIds(ids=list(x)))
             for x in inputs]
    return pb.EmbedRequest(inputs=items, dimensions=dimensions, model=model, request_id=request_id)


def _status_name(resp: health_pb2.HealthCheckResponse) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


class _Base:
    def __init__(self, addresses: str | Sequence[str], api_key: str | None, timeout: float | None,
                 retries: bool, root_certificates: bytes | None, tls: bool) -> None:
        self.target = channel_target(addresses)
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._creds = grpc.ssl_channel_credentials(root_certificates) if (tls or root_certificates) else None
        several = not isinstance(addresses, str) and len(addresses) > 1  # balancing: route around a draining one
        self._options = channel_options(retries, health_check=several)

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout


class Client(_Base):
    """Blocking client. `timeout` (seconds) is the default deadline of every call; None = no deadline."""

    def __init__(self, addresses: str | Sequence[str] = "127.0.0.1:50051", *, api_key: str | None = None,
                 timeout: float | None = 60.0, retries: bool = True, root_certificates: bytes | None = None,
                 tls: bool = False) -> None:
        super().__init__(addresses, api_key, timeout, retries, root_certificates, tls)
        self.channel = (grpc.secure_channel(self.target, self._creds, self._options) if self._creds
                        else grpc.insecure_channel(self.target, self._options))
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def score(self, text: str | None = None, *, timeout: float | None = None, **kw: Any) -> pb.ScoreResponse:
        """Per-token logprobs of `text` (or token_ids=...), with top_logprobs=k alternatives."""
        return self.stub.Score(score_request(text, **kw), timeout=self._t(timeout), metadata=self._metadata)

    def generate(self, text: str | None = None, *, timeout: float | None = None, **kw: Any
                 ) -> Iterator[pb.GenerateResponse]:
        """The Generate stream: `batch` messages, then one `final`. The iterator has .cancel()."""
        return self.stub.Generate(generate_request(text, **kw), timeout=self._t(timeout), metadata=self._metadata)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._t(timeout), metadata=self._metadata)

    def tokenize(self, text: str | None = None, *, timeout: float | None = None, **kw: Any) -> pb.TokenizeResponse:
        return self.stub.Tokenize(tokenize_request(text, **kw), timeout=self._t(timeout), metadata=self._metadata)

    def embed(self, inputs: Sequence[str | Sequence[int]], *, timeout: float | None = None,
              **kw: Any) -> pb.EmbedResponse:
        return self.stub.Embed(embed_request(inputs, **kw), timeout=self._t(timeout), metadata=self._metadata)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """"SERVING" or "NOT_SERVING" (grpc.health.v1 Check)."""
        return _status_name(self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                                   timeout=self._t(timeout)))

    def watch_health(self, service: str = "", timeout: float | None = None) -> Iterator[str]:
        """Each health status change, starting with the current one (grpc.health.v1 Watch)."""
        for resp in self.health_stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=timeout):
            yield _status_name(resp)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client; create it inside the event loop that uses it."""

    def __init__(self, addresses: str | Sequence[str] = "127.0.0.1:50051", *, api_key: str | None = None,
                 timeout: float | None = 60.0, retries: bool = True, root_certificates: bytes | None = None,
                 tls: bool = False) -> None:
        super().__init__(addresses, api_key, timeout, retries, root_certificates, tls)
        self.channel = (grpc.aio.secure_channel(self.target, self._creds, self._options) if self._creds
                        else grpc.aio.insecure_channel(self.target, self._options))
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    async def score(self, text: str | None = None, *, timeout: float | None = None, **kw: Any) -> pb.ScoreResponse:
        return await self.stub.Score(score_request(text, **kw), timeout=self._t(timeout), metadata=self._metadata)

    def generate(self, text: str | None = None, *, timeout: float | None = None, **kw: Any
                 ) -> AsyncIterator[pb.GenerateResponse]:
        """`async for msg in client.generate(...)`; the call object also has .cancel()."""
        return self.stub.Generate(generate_request(text, **kw), timeout=self._t(timeout), metadata=self._metadata)

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=self._t(timeout),
                                            metadata=self._metadata)

    async def tokenize(self, text: str | None = None, *, timeout: float | None = None, **kw: Any
                       ) -> pb.TokenizeResponse:
        return await self.stub.Tokenize(tokenize_request(text, **kw), timeout=self._t(timeout),
                                        metadata=self._metadata)

    async def embed(self, inputs: Sequence[str | Sequence[int]], *, timeout: float | None = None,
                    **kw: Any) -> pb.EmbedResponse:
        return await self.stub.Embed(embed_request(inputs, **kw), timeout=self._t(timeout), metadata=self._metadata)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        return _status_name(await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=self._t(timeout)))

    async def watch_health(self, service: str = "", timeout: float | None = None) -> AsyncIterator[str]:
        async for resp in self.health_stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=timeout):
            yield _status_name(resp)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
