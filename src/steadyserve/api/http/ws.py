"""WebSocket streaming: one JSON request in, one JSON message per token batch out.

Protocol (`WS /v1/stream`):
  client -> {"prompt": ...} or {"messages": [...]} plus sampling fields, once
  server -> {"type": "delta", "text", "token_ids", "logprobs"?, "system_fingerprint"} per batch
  server -> {"type": "final", "finish_reason", "usage", "system_fingerprint", "receipt"?}, then close 1000
            (`"receipt": true` in the request, or the x-steadyserve-receipt header: api/receipts.py)
            (with tools: the deltas carry the raw output, the final also "content" and "tool_calls")
  errors -> {"type": "error", "error": {...}}, then close 1008 (bad request) or 1011 (server)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect

from ...limits import RETRY_REASONS, InvalidRequest, Refused
from .. import json_input
from ..events import StreamStalled, end_status
from ..harmony import read_reply
from ..receipts import HEADER as RECEIPT_HEADER, header_asks, receipt_for
from ..requests import ValidatedRequest, admit
from ..state import ServerState
from ..tools import tool_turn
from ..tracing import note_refusal
from .errors import error_body, refusal_status
from .inputs import build_from_body, client_request_id

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


def _refusal(ws: WebSocket, e: Refused) -> Awaitable[None]:
    """A refused request: its error message (with the HTTP status it would have), then 1013 (retry later) or
    1008 (bad request)."""
    status, type_, _ = refusal_status(e)
    code = CLOSE_TRY_LATER if e.reason in RETRY_REASONS else CLOSE_BAD_REQUEST
    return _fail(ws, code, str(e), type_, e.param, e.reason, status=status, retry_after=e.retry_after)


def _single_choice(req: ValidatedRequest) -> ValidatedRequest:
    """The WebSocket streams one choice of one prompt. Raises InvalidRequest."""
    if req.num_samples != 1:
        raise InvalidRequest("n", "n: the WebSocket streams one choice per request; send n 1 (or leave it out)")
    if len(req.prompts) != 1:
        raise InvalidRequest("prompt", "prompt: the WebSocket streams one prompt per request; send a string or one "
                             "list of token ids")
    return req


async def websocket_stream(ws: WebSocket, state: ServerState) -> None:
    await ws.accept()
    cfg = state.config.server
    try:  # the request message, within --body-timeout of the handshake (an HTTP body's bound)
        message = await asyncio.wait_for(ws.receive(), cfg.body_timeout)
    except WebSocketDisconnect:
        return
    except asyncio.TimeoutError:
        return await _fail(ws, CLOSE_BAD_REQUEST, f"no request message within {cfg.body_timeout:g} s of the "
                           "handshake (--body-timeout)", "invalid_request_error", None, "request_timeout")
    if message["type"] == "websocket.disconnect":
        return
    if message.get("text") is None:
        return await _fail(ws, CLOSE_BAD_REQUEST, "send the request as one JSON text frame, not binary",
                           "invalid_request_error", None, "binary_frame")
    try:
        body = json_input.loads(message["text"], "the request frame")
        if not isinstance(body, dict):
            raise ValueError("not an object")
    except Refused as e:  # nested past limits.MAX_JSON_DEPTH
        return await _refusal(ws, e)
    except ValueError:
        return await _fail(ws, CLOSE_BAD_REQUEST, "the request frame is not a JSON object", "invalid_request_error",
                           None, "invalid_json")
    kind = "chat" if "messages" in body else "completion"
    try:
        req = _single_choice(await state.run_tokenizer(build_from_body, state, body, kind, "ws",
                                                       client_request_id(ws.scope),
                                                       header_asks(ws.headers.get(RECEIPT_HEADER))))
        channel = admit(state, req)
    except Refused as e:
        if state.metrics is not None:
            state.metrics.rejected.labels(e.metric_reason).inc()
        note_refusal(e)
        return await _refusal(ws, e)
    transport = ws.scope.get("state", {}).get("transport")
    fp = str(state.fingerprint)
    want_lp = req.params[0].logprobs is not None

    async def watch() -> None:
        """A second request, a binary frame or a disconnect: each ends the stream cleanly."""
        gone = (await ws.receive())["type"] == "websocket.disconnect"
        channel.cut("client_disconnect")
        if not gone:
            await _fail(ws, CLOSE_BAD_REQUEST, "one request per WebSocket connection", "invalid_request_error",
                        None, "second_request")

    buffered = transport.get_write_buffer_size if transport is not None else None

    async def emit(obj: dict) -> None:
        text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
        await channel.send(ws.send_text(text), len(text), cfg.stall_timeout, buffered)

    try:
        async with channel.watch(disconnected=watch()):
            async for ev in channel:
                if channel.client_gone:
                    break
                # Tokens first, even in a batch that ends in a failure: the client sees what was produced.
                toks, text = ev.token_ids, ev.text
                if toks or text:
                    delta: dict[str, Any] = {"type": "delta", "text": text, "token_ids": toks,
                                             "system_fingerprint": fp}
                    if want_lp:
                        delta["logprobs"] = _lp_json([lp for o in ev.outputs for lp in o.logprobs])
                    await emit(delta)
                if ev.error is not None:
                    code, msg = ev.error
                    end = end_status(code)
                    await _fail(ws, end.ws_close, msg, end.error_type, None, code)
                    break
                if ev.finished:
                    acc = channel.accs[0]
                    final: dict[str, Any] = {"type": "final", "finish_reason": ev.last.finish_reason,
                                             "usage": acc.usage(), "system_fingerprint": fp,
                                             "request_id": req.request_id}
                    if req.tool_format is not None:  # the raw text streamed; the final parses it, as gRPC's
                        turn = tool_turn(req.tool_format, acc.text, req.request_id, 0, ev.last.finish_reason)
                        final["content"] = turn.content
                        final["tool_calls"] = turn.tool_calls
                        final["finish_reason"] = turn.finish_reason
                    if req.harmony:  # the raw text streamed, channels and all; the final reads them
                        reasoning, final["content"] = read_reply(acc.text)
                        if reasoning:
                            final["reasoning_content"] = reasoning
                    if acc.prompt_logprobs is not None:
                        final["prompt_logprobs"] = [None if lp is None else _lp_json([lp])[0]
                                                    for lp in acc.prompt_logprobs]
                    if req.receipt:
                        final["receipt"] = receipt_for(state, req, 0, acc)
                    await emit(final)
                    await ws.close(CLOSE_OK)
    except StreamStalled:
        if transport is not None:
            transport.abort()
    except (WebSocketDisconnect, OSError, RuntimeError):
        channel.cut("client_disconnect")
