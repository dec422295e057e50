"""The /v1/responses routes: create (whole or streamed), retrieve and delete stored responses.

A create is parsed and validated on the tokenizer thread (responses.py -> requests.build, the chat path),
admitted like any request, and encoded from the same events (api/events.py): a whole response object, or
server-sent events whose stream ends with response.completed / response.incomplete or one `error` event.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from ...limits import InvalidRequest, Refused
from ..events import Accumulated, RequestEvents, StreamStalled, end_status
from ..receipts import HEADER as RECEIPT_HEADER, header_asks, receipts_of
from ..requests import ValidatedRequest, admit, build
from ..responses_store import ResponseStore
from ..state import ServerState
from ..streams import StreamHandle
from .inputs import client_request_id, find_surrogate, read_json, validated
from .responses import ResponsesRequest, responses_spec
from .responses_format import EventWriter, ResponseBuilder, conversation_output, sse
from .sse import collect_events, guarded_send, http_disconnect


def prepare(state: ServerState, store: ResponseStore, body: Any, request_id: str, receipt_header: bool = False
            ) -> tuple[ValidatedRequest, ResponsesRequest, list[dict[str, Any]]]:
    """Parse and validate (requests.build), for the tokenizer thread. Raises Refused, named as this API names
    its fields (text.format, input)."""
    bad = find_surrogate(body)
    if bad is not None:
        raise Refused("invalid_unicode", f"{bad}: contains an unpaired UTF-16 surrogate escape; not valid Unicode",
                      bad)
    parsed = validated(ResponsesRequest, body)
    spec, conversation = responses_spec(store, body, request_id, parsed)
    spec.receipt = spec.receipt or receipt_header
    try:
        return build(state, spec), parsed, conversation
    except InvalidRequest as e:
        if e.param == "response_format":
            raise InvalidRequest("text.format", str(e).replace("response_format", "text.format")) from None
        if e.param and e.param.startswith("messages"):
            raise InvalidRequest("input", "input: " + str(e)) from None
        raise


def add_responses_routes(app: FastAPI, state: ServerState, store: ResponseStore) -> None:
    cfg = state.config.server

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API (the subset agent frameworks use): `input` as a string or items (messages,
        function_call, function_call_output), `instructions`, `max_output_tokens`, `temperature`, `top_p`,
        `text.format` (json_schema), function `tools`, `previous_response_id` and `store`; streamed as the
        documented events with `stream: true`. Stored responses live in a bounded in-memory store (the last
        --responses-store-size, at most 64 MiB, oldest evicted first); an id not there is a 404."""
        body = await read_json(request, cfg.max_request_bytes)
        req, parsed, conversation = await state.run_tokenizer(prepare, state, store, body,
                                                              client_request_id(request.scope),
                                                              header_asks(request.headers.get(RECEIPT_HEADER)))
        handles = admit(state, req)
        builder = ResponseBuilder("resp_" + uuid.uuid4().hex, req.request_id, state.model_name,
                                  str(state.fingerprint), parsed, req.tool_format)
        keep = store if parsed.store else None
        receipt = receipts_of(state, req)
        if parsed.stream:
            return ResponsesSSE(handles, builder, keep, conversation, cfg.stall_timeout, receipt)
        events = await collect_events(request.receive, handles)
        if isinstance(events, Response):
            return events
        out = builder.final(events.accs[0])
        if receipt is not None:
            out["receipt"] = receipt(0, events.accs[0])
        if keep is not None:
            keep.put(out, conversation + conversation_output(out))
        return JSONResponse(out)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        """A stored response, as POST /v1/responses returned it; 404 when it is not (or no longer) stored."""
        return JSONResponse(store.get(response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        """Forget a stored response: `{"id", "object": "response", "deleted": true}`; 404 when it is not stored."""
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


class ResponsesSSE(Response):
    """A streamed response: one choice's events as the Responses API names them (responses_format.py)."""

    media_type = "text/event-stream"

    def __init__(self, handles: list[StreamHandle], builder: ResponseBuilder, store: ResponseStore | None,
                 conversation: list[dict[str, Any]], stall_timeout: float,
                 receipt: Callable[[int, Accumulated], dict[str, Any]] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.handles = handles
        self.writer = EventWriter(builder)
        self.store = store  # where the finished response is kept; None with store: false
        self.conversation = conversation
        self.stall_timeout = stall_timeout
        self.receipt = receipt  # api/receipts.py: set when the request asked for one

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = scope.get("state", {}).get("transport")
        events = RequestEvents(self.handles, disconnected=http_disconnect(receive))

        async def emit(evs: list[dict[str, Any]]) -> None:
            data = b"".join(sse(e) for e in evs)
            if data:
                await guarded_send(events, send({"type": "http.response.body", "body": data, "more_body": True}),
                                   len(data), transport, self.stall_timeout)

        w = self.writer
        try:
            async with events:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                await emit(w.start())
                async for ev in events:
                    if events.client_gone:
                        break
                    if ev.error is not None:
                        await emit(w.feed("".join(o.text_delta for o in ev.outputs[:-1]), False))
                        code, message = ev.error
                        await emit([w.event("error", code=code, message=message, param=None,
                                            error_type=end_status(code).error_type)])
                        break
                    await emit(w.feed(ev.text, ev.finished))
                if events.completed and not events.client_gone:
                    closing, body = w.finish(events.accs[0])
                    if self.receipt is not None:  # in response.completed's response object (the same dict)
                        body["receipt"] = self.receipt(0, events.accs[0])
                    await emit(closing)
                    if self.store is not None:
                        self.store.put(body, self.conversation + conversation_output(body))
                if not events.client_gone:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
        except StreamStalled:
            if transport is not None:
                transport.abort()
        except OSError:
            events.cut("client_disconnect")
