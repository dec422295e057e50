"""Abuse at the edge (issue 61, item 5) against a real server on 127.0.0.1, over real sockets.

One server with small limits so that each test is quick: --max-request-bytes 4096 (bodies, WebSocket messages,
gRPC messages), --header-timeout 1, --body-timeout 1, --max-idle-connections 4; the fixed limits are
steadyserve/limits.py's (16 KiB and 100 lines of headers, JSON 64 levels deep, 256 gRPC streams per connection).
Each test refuses one limit by name, in the API's own shape, and shows the server still serves afterwards.
"""

from __future__ import annotations

import json
import socket
import struct
import time

import grpc
import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from steadyserve.client import Client, pb
from steadyserve.limits import GRPC_MAX_CONCURRENT_STREAMS, MAX_HEADER_BYTES, MAX_HEADER_COUNT, MAX_JSON_DEPTH
from steadyserve.testing.server import ServerProcess

C = "/v1/completions"
TIMEOUT_S = 1.0  # --header-timeout and --body-timeout of the server under test
IDLE = 4  # --max-idle-connections


@pytest.fixture(scope="module")
def server(tiny_model: str):
    with ServerProcess(tiny_model, "--max-request-bytes", "4096", "--header-timeout", str(TIMEOUT_S),
                       "--body-timeout", str(TIMEOUT_S), "--max-idle-connections", str(IDLE), threads=1) as s:
        yield s


def _read_response(sock: socket.socket, timeout: float) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one response, read until the server closes or the body is complete."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def _closed(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closed the connection within `timeout` (anything it sent first is skipped)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def _raw(server: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.http_port), timeout=10)


def _still_serves(server: ServerProcess) -> None:
    r = httpx.post(server.http_url + C, json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text


# ---- request body ----------------------------------------------------------------------------------------

def test_body_over_the_limit_is_413_declared_or_chunked(server):
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
    r = httpx.post(server.http_url + C, content=big, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunks():  # no content-length: the body reader counts as it reads
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    r = httpx.post(server.http_url + C, content=chunks(), timeout=30)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"], r.text
    _still_serves(server)


# ---- JSON nesting ----------------------------------------------------------------------------------------

def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH, 1500])
def test_json_nested_past_the_limit_is_refused_by_name(server, levels):
    """One level past it, and deep enough to exhaust json's recursion (once an unhandled RecursionError). At the
    limit itself (63 + the body object = 64) the request gets past the depth check to the next one."""
    body = '{"prompt": "hi", "max_tokens": 1, "extra": ' + _nested(levels) + "}"
    r = httpx.post(server.http_url + C, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_too_deep", r.text
    assert str(MAX_JSON_DEPTH) in r.json()["error"]["message"]
    at_limit = '{"prompt": "hi", "max_tokens": 1, "extra": ' + _nested(MAX_JSON_DEPTH - 1) + "}"
    r = httpx.post(server.http_url + C, content=at_limit, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_field", r.text


def test_json_too_deep_over_websocket_and_grpc(server):
    with connect(f"ws://127.0.0.1:{server.http_port}/v1/stream", open_timeout=30) as ws:
        ws.send('{"prompt": "hi", "x": ' + _nested(500) + "}")
        err = json.loads(ws.recv(timeout=30))
        assert err["error"]["code"] == "json_too_deep", err
    with Client(server.grpc_addr, timeout=30, retries=False) as c:
        tool = pb.Tool(name="f", parameters_json=_nested(MAX_JSON_DEPTH + 1))
        req = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
                                 tools=[tool], params=pb.SamplingParameters(max_tokens=1))
        with pytest.raises(grpc.RpcError) as e:
            list(c.stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "64 levels" in e.value.details()
        assert dict(e.value.trailing_metadata())["steadyserve-error-code"] == "json_too_deep"


# ---- headers ---------------------------------------------------------------------------------------------

def _get(extra: str) -> bytes:
    return f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode()


def test_headers_over_the_size_limit_are_431(server):
    with _raw(server) as s:  # whole lines, in one go
        s.sendall(_get(f"X-Big: {'a' * MAX_HEADER_BYTES}\r\n"))
        status, headers, body = _read_response(s, 10)
        assert status == 431 and json.loads(body)["error"]["code"] == "header_too_large", body
        assert headers["connection"] == "close" and _closed(s, 5)
    with _raw(server) as s:  # one header line that never ends, streamed: refused before it ends
        s.sendall(b"GET /v1/models HTTP/1.1\r\nX-Endless: ")
        sent = 0
        try:
            while sent < 4 * MAX_HEADER_BYTES:
                s.sendall(b"a" * 4096)
                sent += 4096
                time.sleep(0.005)
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, _, body = _read_response(s, 10)
        assert status == 431 and json.loads(body)["error"]["code"] == "header_too_large", body
    with _raw(server) as s:  # just under: served
        s.sendall(_get(f"X-Big: {'a' * (MAX_HEADER_BYTES - 200)}\r\n"))
        assert _read_response(s, 10)[0] == 200
    assert server.metric("steadyserve_http_edge_refusals_total", reason="header_too_large") == 2


def test_too_many_header_lines_are_431(server):
    with _raw(server) as s:
        s.sendall(_get("".join(f"X-H{i}: v\r\n" for i in range(MAX_HEADER_COUNT))))  # + Host = one too many
        status, _, body = _read_response(s, 10)
        assert status == 431 and json.loads(body)["error"]["code"] == "too_many_headers", body
    with _raw(server) as s:
        s.sendall(_get("".join(f"X-H{i}: v\r\n" for i in range(MAX_HEADER_COUNT - 1))))
        assert _read_response(s, 10)[0] == 200


# ---- slow clients ----------------------------------------------------------------------------------------

def _trickle(s: socket.socket, data: bytes, until: float) -> None:
    """One byte every 0.25 s (a slow-loris client) until `until` or the server closes."""
    for b in data:
        if time.monotonic() > until:
            return
        try:
            s.sendall(bytes([b]))
        except (BrokenPipeError, ConnectionResetError):
            return
        time.sleep(0.25)


def _slow_refusal(server: ServerProcess, start: bytes, trickled: bytes) -> tuple[float, dict]:
    with _raw(server) as s:
        t0 = time.monotonic()
        s.sendall(start)
        _trickle(s, trickled, t0 + TIMEOUT_S + 3)
        status, headers, body = _read_response(s, 5)
        took = time.monotonic() - t0
        assert status == 408 and headers["connection"] == "close", body
        assert _closed(s, 5)
        return took, json.loads(body)


def test_slow_headers_are_cut_off_with_408(server):
    took, err = _slow_refusal(server, b"GET /v1/models HTTP/1.1\r\n", b"X-Slow: " + b"a" * 100 + b"\r\n\r\n")
    assert err["error"]["code"] == "request_timeout" and "--header-timeout" in err["error"]["message"]
    assert TIMEOUT_S - 0.1 < took < TIMEOUT_S + 2.5, took
    _still_serves(server)


def test_slow_body_is_cut_off_with_408_in_the_routes_shape(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode() + b" " * 100
    for path, shape in ((C, "openai"), ("/v1/messages", "anthropic")):
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        took, err = _slow_refusal(server, head, body)
        assert TIMEOUT_S - 0.1 < took < TIMEOUT_S + 2.5, took
        if shape == "openai":
            assert err["error"]["code"] == "request_timeout" and "--body-timeout" in err["error"]["message"]
        else:
            assert err["type"] == "error" and "--body-timeout" in err["error"]["message"], err
    _still_serves(server)
    assert "Exception in ASGI application" not in server.logs()


def test_websocket_without_a_request_message_is_closed(server):
    with connect(f"ws://127.0.0.1:{server.http_port}/v1/stream", open_timeout=30) as ws:
        t0 = time.monotonic()
        err = json.loads(ws.recv(timeout=TIMEOUT_S + 5))
        assert err["error"]["code"] == "request_timeout" and time.monotonic() - t0 < TIMEOUT_S + 2
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


# ---- idle connections ------------------------------------------------------------------------------------

def test_idle_keep_alive_connections_past_the_bound_close_the_oldest(server):
    socks: list[socket.socket] = []
    try:
        for _ in range(IDLE + 2):  # one request each, kept alive: each connection is idle after its response
            socks.append(_raw(server))
            socks[-1].sendall(_get(""))
            assert _read_response(socks[-1], 10)[0] == 200
        assert _closed(socks[0], 0.5) and _closed(socks[1], 0.5)  # the two longest idle
        for s in socks[2:]:  # the newest IDLE still serve (well inside --header-timeout)
            s.sendall(_get(""))
            assert _read_response(s, 10)[0] == 200
        assert server.metric("steadyserve_http_edge_refusals_total", reason="idle_evicted") >= 2
    finally:
        for s in socks:
            s.close()


def test_a_connection_that_never_sends_is_closed(server):
    with _raw(server) as s:
        t0 = time.monotonic()
        assert _closed(s, TIMEOUT_S + 3)
        assert time.monotonic() - t0 < TIMEOUT_S + 2


# ---- WebSocket frames and messages -----------------------------------------------------------------------

def test_websocket_message_and_frame_over_the_limit_close_1009(server):
    url = f"ws://127.0.0.1:{server.http_port}/v1/stream"
    with connect(url, open_timeout=30, max_size=None) as ws:
        ws.send(json.dumps({"prompt": "x" * 5000}))  # one 5 KB message
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    with connect(url, open_timeout=30) as ws:
        # A frame header announcing 1 MiB, and none of the payload: refused from the header alone.
        ws.socket.sendall(b"\x81\xff" + struct.pack(">Q", 1 << 20) + b"\x00\x00\x00\x00")
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


# ---- gRPC ------------------------------------------------------------------------------------------------

def test_grpc_message_over_the_limit_is_resource_exhausted(server):
    with Client(server.grpc_addr, timeout=30, retries=False) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.score("x" * 5000)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert c.score("hi").usage.prompt_tokens > 0


def _frame(ftype: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + stream.to_bytes(4, "big") + payload


def _literal(name: str, value: str) -> bytes:
    """HPACK: literal header field without indexing, new name, no Huffman (lengths < 127)."""
    return b"\x00" + bytes([len(name)]) + name.encode() + bytes([len(value)]) + value.encode()


def test_grpc_streams_past_the_per_connection_bound_are_refused(server):
    """Raw HTTP/2: open one stream more than SETTINGS_MAX_CONCURRENT_STREAMS (each a Health/Watch call whose
    request never comes); the server resets that one with REFUSED_STREAM and keeps the rest."""
    block = b"".join(_literal(k, v) for k, v in ((":method", "POST"), (":scheme", "http"),
                                                    (":path", "/grpc.health.v1.Health/Watch"),
                                                    (":authority", "127.0.0.1"), ("content-type", "application/grpc"),
                                                    ("te", "trailers")))
    n = GRPC_MAX_CONCURRENT_STREAMS + 1
    with socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0) + _frame(4, 1, 0))  # SETTINGS, ACK
        s.sendall(b"".join(_frame(1, 0x4, 2 * i + 1, block) for i in range(n)))  # HEADERS, END_HEADERS
        refused, buf, deadline = [], b"", time.monotonic() + 10
        while not refused and time.monotonic() < deadline:
            try:
                buf += s.recv(65536)
            except socket.timeout:
                break
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                length, ftype, sid = int.from_bytes(buf[:3], "big"), buf[3], int.from_bytes(buf[5:9], "big")
                payload, buf = buf[9:9 + length], buf[9 + length:]
                if ftype == 3:  # RST_STREAM
                    refused.append((sid, int.from_bytes(payload, "big")))
    assert refused == [(2 * (n - 1) + 1, 7)], refused  # the last stream, REFUSED_STREAM
