"""Helpers shared by the HTTP / WebSocket test files: raw SSE clients, metric reads."""

from __future__ import annotations

import json
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
