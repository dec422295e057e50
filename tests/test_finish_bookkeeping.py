"""Finish bookkeeping does not depend on a reader: every admitted request gets exactly one "request done" log
line and one `steadyserve_requests_finished_total` count, however its transport ended (a client that hangs up
before reading a byte, a gRPC call cancelled mid-stream), because both are written as the engine's outputs are
delivered, not as a transport consumes them.
"""

from __future__ import annotations

import json
import socket
import urllib.request
import time

import grpc
import pytest

from http_util import wait_for
from steadyserve.client import Client
from steadyserve.testing.server import ServerProcess


@pytest.fixture(scope="module")
def srv(tiny_model: str):
    with ServerProcess(tiny_model, "--log-format", "json") as s:
        yield s


def finished_total(srv) -> float:
    return sum(srv.metric("steadyserve_requests_finished_total", finish_reason=r)
               for r in ("stop", "length", "abort", "error"))


def done_lines(srv, prefix: str) -> list[dict]:
    lines = []
    for line in srv.logs().splitlines():
        if '"request done"' in line:
            rec = json.loads(line)
            if rec.get("request_id", "").startswith(prefix):
                lines.append(rec)
    return lines


def test_clients_that_hang_up_unread_are_each_recorded_once(srv) -> None:
    before = finished_total(srv)
    n = 20
    for i in range(n):
        body = json.dumps({"prompt": "the fox", "max_tokens": 50, "ignore_eos": True, "stream": True}).encode()
        s = socket.create_connection(("127.0.0.1", srv.http_port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"x-request-id: hangup-{i}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.05 if i % 2 else 0.0)  # some hang up before the first token, some after
        s.close()  # not one byte read
    wait_for(lambda: finished_total(srv) >= before + n, 60, what="every request finished")
    time.sleep(0.5)
    assert finished_total(srv) == before + n
    lines = done_lines(srv, "hangup-")
    assert sorted(r["request_id"] for r in lines) == sorted(f"hangup-{i}" for i in range(n))  # one line each


def test_cancelled_grpc_streams_are_each_recorded_once(srv) -> None:
    before = finished_total(srv)
    n = 8
    with Client(srv.grpc_addr) as c:
        for i in range(n):
            call = c.generate("the fox", max_tokens=60, temperature=0, ignore_eos=True, request_id=f"cancel-{i}")
            next(iter(call))  # the first batch arrives, then the client cancels
            call.cancel()
            with pytest.raises(grpc.RpcError):
                for _ in call:
                    pass
    wait_for(lambda: finished_total(srv) >= before + n, 60, what="every request finished")
    time.sleep(0.5)
    assert finished_total(srv) == before + n
    assert sorted(r["request_id"] for r in done_lines(srv, "cancel-")) == sorted(f"cancel-{i}" for i in range(n))


def test_a_thousand_requests_with_disconnects_leave_no_per_request_state(srv) -> None:
    """1,000 requests, a third hung up unread, a third streamed to the end, a third whole: every one finishes
    exactly once in the counts, and the metrics' per-request state returns to 0."""
    import asyncio

    import httpx

    before = finished_total(srv)
    n = 1000
    body = {"prompt": "the fox", "max_tokens": 3, "ignore_eos": True}

    async def run() -> None:
        gate = asyncio.Semaphore(32)  # well inside the server's capacity: nothing is refused
        async with httpx.AsyncClient(base_url=srv.http_url, timeout=60) as client:
            async def one(i: int) -> None:
                async with gate:
                    if i % 3 == 0:  # hang up unread
                        raw = json.dumps({**body, "stream": True}).encode()
                        _, w = await asyncio.open_connection("127.0.0.1", srv.http_port)
                        w.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                + f"content-length: {len(raw)}\r\n\r\n".encode() + raw)
                        await w.drain()
                        w.close()
                    elif i % 3 == 1:
                        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                            await r.aread()
                    else:
                        assert (await client.post("/v1/completions", json=body)).status_code == 200

            await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(run())
    wait_for(lambda: finished_total(srv) >= before + n, 120, what="every request finished")
    wait_for(lambda: srv.metric("steadyserve_requests_tracked") == 0, 30, what="no tracked requests")
    time.sleep(0.5)
    assert finished_total(srv) == before + n
    assert srv.metric("steadyserve_requests_tracked") == 0


def test_the_request_line_says_where_the_first_token_waited(srv) -> None:
    """The line splits the time to first token: the queue wait, then the engine's step that emitted it, then the
    event loop's handling of it (ttft_s): each later than the one before, all from the same admission."""
    body = {"prompt": "the fox", "max_tokens": 4, "ignore_eos": True}
    req = urllib.request.Request(f"{srv.http_url}/v1/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json", "x-request-id": "timed-1"})
    urllib.request.urlopen(req, timeout=60).read()
    wait_for(lambda: done_lines(srv, "timed-1"), 30, what="the request's line")
    (rec,) = done_lines(srv, "timed-1")
    assert rec["preemptions"] == 0
    assert 0 <= rec["queue_s"] <= rec["engine_ttft_s"] <= rec["ttft_s"] <= rec["total_s"], rec
