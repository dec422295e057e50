"""Helpers shared by the HTTP / WebSocket test files: raw SSE clients, metric reads."""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Any

import httpx

FP_HEADER = "x-steadyserve-fingerprint"


def sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of an SSE body, in order (event boundaries are blank lines)."""
    out = []
    for block in raw.decode("utf-8").split("\n\n"):
        block = block.strip("\n")
        if not block:
            continue
        lines = [ln for ln in block.split("\n") if ln.startswith("data: ")]
        assert lines, f"SSE block without data: {block!r}"
        out.append("\n".join(ln[6:] for ln in lines))
    return out


def parse_stream(raw: bytes) -> tuple[list[dict[str, Any]], bool]:
    """(JSON chunks, ended with [DONE] as the very last event)."""
    events = sse_events(raw)
    done = bool(events) and events[-1] == "[DONE]"
    assert events.count("[DONE]") <= 1, "more than one [DONE]"
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return chunks, done


def stream_completion(client: httpx.Client, path: str, body: dict[str, Any],
                      **kw: Any) -> tuple[httpx.Response, list[dict[str, Any]], bool]:
    with client.stream("POST", path, json={**body, "stream": True}, **kw) as r:
        raw = r.read()
    if r.status_code != 200:
        return r, [json.loads(raw)], False
    chunks, done = parse_stream(raw)
    return r, chunks, done


def raw_http(port: int, request: bytes, timeout: float = 30.0, rcvbuf: int | None = None) -> bytes:
    """Send bytes on a fresh socket; return everything the server sends until it closes or times out."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    try:
        s.sendall(request)
        data = b""
        while True:
            try:
                part = s.recv(65536)
            except socket.timeout:
                break
            if not part:
                break
            data += part
            if b"\r\n0\r\n\r\n" in data or (b"content-length:" in data.lower() and _complete(data)):
                break
        return data
    finally:
        s.close()


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def post_request(port: int, path: str, body: bytes, extra_headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra_headers}Connection: close\r\n\r\n").encode() + body


def wait_for(pred, timeout: float, interval: float = 0.05, what: str = "condition") -> float:
    """Poll `pred` until true; returns the seconds it took. Fails the test on timeout."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def status_counts(server) -> dict[str, float]:
    """http_requests_total summed by status code."""
    out: dict[str, float] = {}
    for (name, labels), v in server.metrics().items():
        if name == "http_requests_total":
            st = dict(labels)["status"]
            out[st] = out.get(st, 0.0) + v
    return out


def five_xx(server) -> float:
    return sum(v for k, v in status_counts(server).items() if k.startswith("5"))


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of a real server that cuts every other stream cleanly mid-way.

    It stands for a worker killed mid-stream behind a balancer: the client sees a well-formed end (the
    chunked terminator for SSE, a WebSocket close 1000) without a finish reason. Streams are a POST with
    `"stream": true` or a WebSocket upgrade; of those, the 1st, 3rd, 5th ... connection is cut after
    `keep` body chunks / frames. Everything else is piped untouched. `cut` counts the streams it cut short: those
    whose forwarded part carried no finish reason (on a loaded machine the server may send a short stream's tokens in
    fewer events, its finish among the first `keep`; that stream reached its client whole).
    """

    def __init__(self, upstream_port: int, keep: int = 3) -> None:
        import asyncio
        import threading

        self.upstream_port, self.keep = upstream_port, keep
        self.cut = 0
        self.streams = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def start() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()

        self._thread = threading.Thread(target=lambda: (self._loop.run_until_complete(start()),
                                                        self._loop.run_forever()), daemon=True)
        self._thread.start()
        assert ready.wait(10), "proxy did not start"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, cr, cw) -> None:
        import asyncio

        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            cw.close()
            return
        try:
            head = await cr.readuntil(b"\r\n\r\n")
            low = head.lower()
            body = b""
            if b"content-length:" in low:
                n = int(low.split(b"content-length:")[1].split(b"\r\n")[0])
                body = await cr.readexactly(n)
            is_ws = b"upgrade: websocket" in low
            is_stream = is_ws or (head.startswith(b"POST ") and b'"stream": true' in body.replace(b'"stream":true',
                                                                                               b'"stream": true'))
            cut = False
            if is_stream:
                self.streams += 1
                cut = self.streams % 2 == 1
            uw.write(head + body)
            await uw.drain()
            if not cut:
                await asyncio.gather(self._pipe(cr, uw), self._pipe(ur, cw))
                return
            pump = asyncio.ensure_future(self._pipe(cr, uw))  # the client's side (WS frames) goes on up
            rhead = await ur.readuntil(b"\r\n\r\n")
            cw.write(rhead)
            sent = b""
            if is_ws:
                for _ in range(self.keep):
                    sent += await self._ws_frame(ur)
                cw.write(sent + b"\x88\x02\x03\xe8")  # close 1000, no reason: a clean end without a final message
            else:
                for _ in range(self.keep):
                    size_line = await ur.readuntil(b"\r\n")
                    size = int(size_line.split(b";")[0], 16)
                    chunk = await ur.readexactly(size + 2)
                    sent += size_line + chunk
                    if size == 0:
                        break
                cw.write(sent + b"0\r\n\r\n")  # the chunked terminator: a well-formed end of the body
            await cw.drain()
            if not re.search(rb'"finish_reason": ?"', sent):
                self.cut += 1
            pump.cancel()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            for w in (cw, uw):
                w.close()

    @staticmethod
    async def _ws_frame(r) -> bytes:
        h = await r.readexactly(2)
        n = h[1] & 0x7F
        ext = b""
        if n == 126:
            ext = await r.readexactly(2)
            n = int.from_bytes(ext, "big")
        elif n == 127:
            ext = await r.readexactly(8)
            n = int.from_bytes(ext, "big")
        return h + ext + await r.readexactly(n)

    @staticmethod
    async def _pipe(r, w) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (OSError, Exception):  # noqa: BLE001  the other side went away
            pass
        finally:
            w.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()

        import asyncio
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "CuttingProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
