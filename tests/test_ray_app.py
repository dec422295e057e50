"""The Ray Serve application's pieces that need no cluster (tests/test_ray_serve.py runs one).

build_app's arguments (the one config tree: `steadyserve serve` flags, validated before deploying),
the Ray options derived from them, the gRPC messages pickling (Ray's gRPC proxy pickles each request
to its replica), the ingress ending a stream whose replica is lost with an explicit error event, and the
replica grouping the gRPC messages that wait for Ray into one, and the replica's connections to its child
server expiring before the server closes them.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import socket
import time

import pytest

from steadyserve.api.protos.steadyserve.v1 import inference_pb2
from steadyserve.ray.app import RayAppArgs, build_app, engine_options, parse_serve_args
from steadyserve.ray.ingress import relay_events
from steadyserve.limits import HTTP_KEEP_ALIVE_S, POOLED_IDLE_S
from steadyserve.ray.replica import _arrived, child_client, merge_batches
from steadyserve.tools.sse_client import StreamResult, _on_event


def test_serve_args_are_the_cli_flags() -> None:
    cfg = parse_serve_args(["--max-num-seqs", "8", "--max-queue", "4", "--drain-timeout", "30"])
    assert (cfg.engine.max_num_seqs, cfg.engine.max_queue, cfg.server.drain_timeout) == (8, 4, 30.0)
    with pytest.raises(ValueError, match="--http-port"):
        parse_serve_args(["--http-port", "8000"])
    with pytest.raises(ValueError, match="--ready-file"):
        parse_serve_args(["--ready-file=/tmp/x"])
    with pytest.raises(ValueError, match="--max-queue"):  # argparse's refusal, named
        parse_serve_args(["--max-queue", "many"])
    with pytest.raises(ValueError, match="max-num-batched-tokens"):  # the config tree's own validation
        parse_serve_args(["--max-num-seqs", "64", "--max-num-batched-tokens", "8"])
    with pytest.raises(ValueError):  # unknown keys in the application's args are refused, not ignored
        RayAppArgs.model_validate({"serve_arg": []})
    with pytest.raises(ValueError, match="--grpc-port"):
        build_app({"serve_args": ["--grpc-port", "1"]})


def test_ray_options_follow_the_flags() -> None:
    cfg = parse_serve_args(["--max-num-seqs", "8", "--max-queue", "4", "--drain-timeout", "30", "--threads", "2"])
    o = engine_options(cfg, {})
    assert o["max_ongoing_requests"] == 12  # what the engine admits: running + queued
    assert o["max_queued_requests"] == 12  # a burst one replica admits waits for assignment, never refused
    assert o["graceful_shutdown_timeout_s"] == 35.0
    assert o["ray_actor_options"] == {"num_cpus": 2}
    o = engine_options(cfg, {"num_replicas": 3, "autoscaling_config": {"min_replicas": 1, "max_replicas": 4},
                             "max_queued_requests": 100})
    assert "num_replicas" not in o and o["max_queued_requests"] == 100
    assert o["autoscaling_config"] == {"target_ongoing_requests": 8, "min_replicas": 1, "max_replicas": 4}


def test_grpc_messages_pickle_by_their_module() -> None:
    """Ray's gRPC proxy pickles the parsed request; protoc names the messages' module
    `steadyserve.v1.inference_pb2`, which cannot be imported, unless codegen gives the real one."""
    msg = inference_pb2.GenerateRequest(text="hello", params={"max_tokens": 3})
    assert inference_pb2.GenerateRequest.__module__ == inference_pb2.__name__
    assert pickle.loads(pickle.dumps(msg)) == msg


class _LostMidStream:
    """A handle's response stream whose replica dies after its events (by default, two text events)."""

    def __init__(self, items: list[bytes] | None = None) -> None:
        self.items = items if items is not None else [b"data: {\"choices\": [{\"text\": \"a\"}]}\n\n",
                                                      b"data: {\"choices\": [{\"text\": \"b\"}]}\n\n"]
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if self.items:
            return self.items.pop(0)
        raise RuntimeError("ActorDiedError: the replica died")

    def cancel(self) -> None:
        self.cancelled = True


def test_a_stream_whose_replica_is_lost_ends_with_an_error_event() -> None:
    async def collect() -> bytes:
        return b"".join([chunk async for chunk in relay_events(_LostMidStream())])

    body = asyncio.run(collect())
    events = [e for e in body.split(b"\n\n") if e]
    assert len(events) == 4 and events[-1] == b"data: [DONE]"
    error = json.loads(events[2][len(b"data: "):])["error"]
    assert error["code"] == "replica_lost" and "retry" in error["message"]


def test_a_stream_lost_after_its_done_gets_no_error_event_and_one_lost_before_it_does() -> None:
    """A replica that dies after [DONE] was relayed (before Ray saw its generator end) adds nothing: the client
    has the whole stream. One that dies between the finish chunk and [DONE] ends with replica_lost and [DONE].
    (CI once counted a stream of the kill test both finished and lost.)"""
    async def relayed(items: list[bytes]) -> StreamResult:
        body = b"".join([chunk async for chunk in relay_events(_LostMidStream(items))])
        res = StreamResult(status=200)
        for event in body.split(b"\n\n"):
            if event:
                _on_event(event, res)
        return res

    text = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
    last = b'data: {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}\n\n'
    whole = asyncio.run(relayed([text, last, b"data: [DONE]\n\n"]))
    assert whole.done and whole.finish_reason == "length" and whole.error is None
    assert whole.num_events_after_done == 0
    cut = asyncio.run(relayed([text, last]))
    assert cut.done and cut.error["code"] == "replica_lost" and cut.num_events_after_done == 0


def _batch(ids: list[int], text: str) -> bytes:
    lps = [inference_pb2.TokenLogprob(token_id=i, logprob=-float(i)) for i in ids]
    return inference_pb2.GenerateResponse(batch=inference_pb2.TokenBatch(token_ids=ids, text=text,
                                                                         logprobs=lps)).SerializeToString()


def test_token_batches_waiting_together_go_as_one_and_the_final_stays_last() -> None:
    final = inference_pb2.GenerateResponse(final=inference_pb2.GenerateFinal(request_id="r")).SerializeToString()
    out = merge_batches([_batch([1], "a"), _batch([2, 3], "bc"), _batch([4], "\u00e9"), final])
    assert len(out) == 2 and out[1] == final
    merged = inference_pb2.GenerateResponse.FromString(out[0]).batch
    assert list(merged.token_ids) == [1, 2, 3, 4] and merged.text == "abc\u00e9"
    assert [lp.token_id for lp in merged.logprobs] == [1, 2, 3, 4]
    assert merge_batches([_batch([7], "x")]) == [_batch([7], "x")]  # alone: the bytes as they came


class _Call:
    """A grpc.aio server-streaming call: `arrivals` are (seconds to wait, message or exception). `delivered` is
    set once every message has been handed out (before the call ends)."""

    def __init__(self, arrivals: list) -> None:
        self.arrivals, self.cancelled = arrivals, False
        self.delivered = asyncio.Event()

    async def __aiter__(self):
        for delay, item in self.arrivals:
            await asyncio.sleep(delay)
            if isinstance(item, Exception):
                raise item
            yield item
        self.delivered.set()

    def cancel(self) -> None:
        self.cancelled = True


def test_messages_are_grouped_as_they_waited_for_a_busy_consumer() -> None:
    """Quiet (the consumer is back before the next message), one message per group; a consumer that was busy
    while three arrived gets the three at once; an error comes after the messages before it. No timing
    margin decides a group: a woken consumer runs before the reader's next timer, and the busy one is busy
    exactly until the call has delivered everything."""
    async def groups(arrivals: list, busy: bool) -> list:
        call = _Call(arrivals)  # made inside the loop that runs it (its Event belongs to that loop)
        out = []
        async for group in _arrived(call):
            out.append(group)
            if busy:  # handing the group to Ray while the rest arrives
                await call.delivered.wait()
        return out

    quiet = [(0.02, b"a"), (0.02, b"b"), (0.02, b"c")]
    assert asyncio.run(groups(quiet, False)) == [[b"a"], [b"b"], [b"c"]]
    burst = [(0, b"a"), (0.01, b"b"), (0, b"c"), (0, b"d")]
    assert asyncio.run(groups(burst, True)) == [[b"a"], [b"b", b"c", b"d"]]
    broken = [(0, b"a"), (0, RuntimeError("lost"))]
    with pytest.raises(RuntimeError, match="lost"):
        asyncio.run(groups(broken, False))


def test_a_consumer_that_leaves_cancels_the_call() -> None:
    async def leave(call: _Call) -> None:
        gen = _arrived(call)
        assert await gen.__anext__() == [b"a"]
        await gen.aclose()

    call = _Call([(0, b"a"), (10, b"never")])
    asyncio.run(leave(call))
    assert call.cancelled


def _idle_until_closed(host: str, port: int) -> float:
    """Seconds a kept-alive connection stays open after one answered request, until the server closes it."""
    with socket.create_connection((host, port), timeout=HTTP_KEEP_ALIVE_S + 10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got:
            got += s.recv(65536)
        head, body = got.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(body) < length:
            body += s.recv(65536)
        start = time.monotonic()
        assert s.recv(1) == b"", "the server sent more than one answer"
        return time.monotonic() - start


def test_the_replica_drops_idle_connections_before_its_child_server_closes_them(server) -> None:
    """The child (`steadyserve serve`) closes a connection idle HTTP_KEEP_ALIVE_S; the replica's client drops its
    own after POOLED_IDLE_S, so it never sends a request on one the server is closing. With both at 5 s, the Ray
    tests' replicas met httpx.ReadError on pooled connections 4.6 s idle (the ingress retried), and twice a holder
    got 503 replica_lost, as when the retry meets the same race."""
    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    closed = _idle_until_closed(host, int(port))
    # Timed from when this process read the answer, which a starved host delays: the lower bound is the claim (the
    # server keeps it open well past the client's expiry), not HTTP_KEEP_ALIVE_S itself; 2 s above is a late timer.
    assert 2 * POOLED_IDLE_S < closed < HTTP_KEEP_ALIVE_S + 2, closed

    async def local_ports(pause: float) -> tuple[int, int]:
        async with child_client(server.http_url) as client:
            ports = []
            for wait in (0, pause):
                await asyncio.sleep(wait)
                async with client.stream("GET", "/healthz") as r:
                    assert r.status_code == 200
                    ports.append(r.extensions["network_stream"].get_extra_info("client_addr")[1])
                    await r.aread()
            return ports[0], ports[1]

    reused = asyncio.run(local_ports(0.0))
    assert reused[0] == reused[1], reused  # kept alive: the test can tell a reused connection
    # Idle longer than POOLED_IDLE_S but well inside the server's keep-alive: a new connection all the same.
    expired = asyncio.run(local_ports(2 * POOLED_IDLE_S))
    assert expired[0] != expired[1], expired
