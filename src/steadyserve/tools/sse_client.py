"""A minimal HTTP/1.1 SSE client on asyncio streams, with control over reading.

httpx reads sockets as fast as it can; a load generator that must play slow
readers (a limited byte rate, a small receive buffer) or clients that hang up
mid-stream needs to decide when bytes leave the kernel. This client does.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class StreamResult:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]
    num_events_after_done: int = 0  # events a server sent after [DONE] (a client ignores them; none is right)
    finish_reason: str | None = None
    error: dict[str, Any] | None = None  # an error event, or the error body of a non-200
    t_start: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival time of each event with text/tokens
    num_tokens: int = 0  # events with text or logprobs (a coalesced event or a silent token under-counts)
    usage_tokens: int | None = None  # completion_tokens of a usage object, when the server sent one
    text: str = ""
    bytes_read: int = 0
    disconnected: bool = False  # we hung up on purpose
    exception: str | None = None

    @property
    def truncated(self) -> bool:
        """Ended without a finish reason or an error event (and we did not hang up)."""
        return self.status == 200 and not self.disconnected and self.finish_reason is None and self.error is None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.t_start if self.token_times else None


class _Reader:
    def __init__(self, reader: asyncio.StreamReader, rate: float | None, result: StreamResult) -> None:
        self.r = reader
        self.rate = rate  # bytes per second, None = as fast as possible
        self.result = result
        self.t0 = time.monotonic()

    async def read(self, n: int) -> bytes:
        if self.rate:
            n = min(n, 256)
        data = await self.r.read(n)
        self.result.bytes_read += len(data)
        if self.rate:  # sleep until our average rate is back under the limit
            ahead = self.result.bytes_read / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                await asyncio.sleep(ahead)
        return data


async def sse_post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None, *,
                   read_rate: float | None = None, rcvbuf: int | None = None,
                   disconnect_after_events: int | None = None, timeout: float = 300.0,
                   result: StreamResult | None = None) -> StreamResult:
    """POST a streaming request and read its SSE events. `result`, when given, is filled as events arrive (a
    caller can watch a stream's progress while it runs) and returned."""
    u = urlsplit(url)
    host, port = u.hostname or "127.0.0.1", u.port or 80
    res = result if result is not None else StreamResult()
    res.t_start = time.monotonic()
    payload = json.dumps(body).encode()
    lines = [f"POST {u.path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(payload)}", "Accept: text/event-stream", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    writer = None
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, port)), 10)
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096 if read_rate else 2 ** 16)
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        await asyncio.wait_for(_read_response(_Reader(reader, read_rate, res), res, disconnect_after_events), timeout)
    except asyncio.TimeoutError:
        res.exception = "timeout"
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        res.exception = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
        else:
            sock.close()
    return res


async def _read_line(r: _Reader, buf: bytearray) -> bytes:
    while b"\r\n" not in buf:
        chunk = await r.read(4096)
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(buf), None)
        buf += chunk
    i = buf.index(b"\r\n")
    line = bytes(buf[:i])
    del buf[:i + 2]
    return line


async def _read_exact(r: _Reader, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        chunk = await r.read(max(4096, n - len(buf)))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(buf), n)
        buf += chunk
    data = bytes(buf[:n])
    del buf[:n]
    return data


async def _body_chunks(r: _Reader, buf: bytearray, headers: dict[str, str]):
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await _read_line(r, buf)).split(b";")[0], 16)
            if size == 0:
                return
            yield await _read_exact(r, buf, size)
            await _read_exact(r, buf, 2)
    elif "content-length" in headers:
        yield await _read_exact(r, buf, int(headers["content-length"]))
    else:
        if buf:
            yield bytes(buf)
            buf.clear()
        while chunk := await r.read(4096):
            yield chunk


async def _read_response(r: _Reader, res: StreamResult, disconnect_after: int | None) -> None:
    buf = bytearray()
    status_line = await _read_line(r, buf)
    res.status = int(status_line.split()[1])
    while line := await _read_line(r, buf):
        k, _, v = line.decode("latin-1").partition(":")
        res.headers[k.strip().lower()] = v.strip()
    pending = b""
    async for chunk in _body_chunks(r, buf, res.headers):
        if res.status != 200:
            pending += chunk
            continue
        pending += chunk
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            _on_event(event, res)
            if disconnect_after is not None and len(res.events) >= disconnect_after and not res.done:
                res.disconnected = True
                return
    if res.status != 200:
        try:
            res.error = json.loads(pending).get("error")
        except ValueError:
            res.error = {"message": pending.decode(errors="replace")}


def _on_event(event: bytes, res: StreamResult) -> None:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if res.done:
            res.num_events_after_done += 1
        if data == b"[DONE]":
            res.done = True
            continue
        obj = json.loads(data)
        res.events.append(obj)
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            res.usage_tokens = usage["completion_tokens"]
        if "error" in obj:
            res.error = obj["error"]
            continue
        for ch in obj.get("choices") or []:
            text = ch.get("text")
            if text is None:
                text = (ch.get("delta") or {}).get("content") or ""
            lp = ch.get("logprobs")
            n = len(lp.get("tokens") or lp.get("content") or []) if lp else (1 if text else 0)
            if text or n:
                res.token_times.append(time.monotonic())
            res.num_tokens += n
            res.text += text
            if ch.get("finish_reason"):
                res.finish_reason = ch["finish_reason"]
