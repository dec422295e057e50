"""WebSocket streaming: one JSON request in, one JSON message per token batch out.

Protocol (`WS /v1/stream`):
  client -> {"prompt": ...} or {"messages": [...]} plus sampling fields, once
  server -> {"type": "delta", "text", "token_ids", "logprobs"?, "system_fingerprint"} per batch
  server -> {"type": "final", "finish_reason", "usage", "system_fingerprint"}, then close 1000
  errors -> {"type": "error", "error": {...}}, then close 1008 (bad request) or 1011 (server)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from ...engine.engine import AdmissionError
from .errors import ADMISSION_STATUS, error_body
from .inputs import BadRequest, submit_unique
from .openai_format import Accumulated
from .sse import StreamStalled, guarded_send

CLOSE_OK, CLOSE_BAD_REQUEST, CLOSE_SERVER_ERROR, CLOSE_TRY_LATER = 1000, 1008, 1011, 1013


async def _fail(ws: WebSocket, code: int, message: str, type_: str, param: str | None = None,
                err_code: str | None = None, **extra: Any) -> None:
    try:
        await ws.send_text(json.dumps({"type": "error", **error_body(message, type_, param, err_code), **extra}))
        await ws.close(code)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass


def _lp_json(lps) -> list[dict[str, Any]]:
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]} for lp in lps]


async def websocket_stream(ws: WebSocket, state, run_prepare: Callable) -> None:
    await ws.accept()
    cfg = state.config.server
    try:
        message = await ws.receive()
    except WebSocketDisconnect:
        return
    if message["type"] == "websocket.disconnect":
        return
    if message.get("text") is None:
        return await _fail(ws, CLOSE_BAD_REQUEST, "send the request as one JSON text frame, not binary",
                           "invalid_request_error", None, "binary_frame")
    try:
        body = json.loads(message["text"])
        if not isinstance(body, dict):
            raise ValueError("not an object")
    except ValueError:
        return await _fail(ws, CLOSE_BAD_REQUEST, "the request frame is not a JSON object", "invalid_request_error",
                           None, "invalid_json")
    try:
        kind, ids, params, _ = await run_prepare(body)
    except BadRequest as e:
        return await _fail(ws, CLOSE_BAD_REQUEST, str(e), "invalid_request_error", e.param, e.code)
    request_id = ws.scope["state"]["request_id"]
    try:
        stream = submit_unique(state, request_id, ids, params, "ws")
    except AdmissionError as e:
        if state.metrics is not None:
            state.metrics.rejected.labels(e.reason).inc()
        status, type_ = ADMISSION_STATUS.get(e.reason, (400, "invalid_request_error"))
        code = CLOSE_TRY_LATER if status in (429, 503) else CLOSE_BAD_REQUEST
        return await _fail(ws, code, str(e), type_, e.param, e.reason, status=status, retry_after=e.retry_after)
    handle = state.streams.open_stream(request_id, stream, "ws")
    transport = ws.scope.get("state", {}).get("transport")
    fp = str(state.fingerprint)

    async def watch() -> None:
        """A second request, a binary frame or a disconnect: each ends the stream cleanly."""
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                handle.cut("client_disconnect")
                return
            handle.cut("client_disconnect")
            await _fail(ws, CLOSE_BAD_REQUEST, "one request per WebSocket connection", "invalid_request_error",
                        None, "second_request")
            return

    watcher = asyncio.create_task(watch())

    async def emit(obj: dict) -> None:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        await guarded_send(ws.send_text(text), len(text), handle, transport, cfg.stall_timeout)

    acc = Accumulated()
    try:
        async for batch in handle.batches():
            for out in batch:
                acc.add(out)
            last = batch[-1]
            if handle.end_reason == "client_disconnect":
                break
            # Tokens first, even in a batch that ends in a failure: the client sees what was produced.
            toks = [t for o in batch for t in o.new_token_ids]
            text = "".join(o.text_delta for o in batch)
            if toks or text:
                delta: dict[str, Any] = {"type": "delta", "text": text, "token_ids": toks, "system_fingerprint": fp}
                if params.logprobs is not None:
                    delta["logprobs"] = _lp_json([lp for o in batch for lp in o.logprobs])
                await emit(delta)
            problem = handle.error_for(last) if last.finished else None
            if problem is not None:
                code, msg = problem
                await _fail(ws, CLOSE_BAD_REQUEST if code == "request_error" else CLOSE_SERVER_ERROR, msg,
                            "server_error", None, code)
                break
            if last.finished:
                final: dict[str, Any] = {"type": "final", "finish_reason": last.finish_reason, "usage": acc.usage(),
                                         "system_fingerprint": fp, "request_id": request_id}
                if acc.prompt_logprobs is not None:
                    final["prompt_logprobs"] = [None if lp is None else _lp_json([lp])[0]
                                                for lp in acc.prompt_logprobs]
                await emit(final)
                await ws.close(CLOSE_OK)
    except StreamStalled:
        if transport is not None:
            transport.abort()
    except (WebSocketDisconnect, OSError, RuntimeError):
        handle.cut("client_disconnect")
    finally:
        watcher.cancel()
        handle.stream.abort()
        state.streams.close(handle)
        handle.backlog_bytes = 0
