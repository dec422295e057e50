"""The /v1/responses routes: create (whole or streamed), retrieve and delete stored responses.

A create is parsed and validated on the tokenizer thread (responses.py -> requests.build, the chat path),
admitted like any request, and encoded from its channel (engine/channel.py; streamed through sse.py's
SSEStream with ResponsesEncoder): a whole response object, or
server-sent events whose stream ends with response.completed / response.incomplete or one `error` event.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ...limits import InvalidRequest, Refused
from ..events import Accumulated, Event, RequestChannel, end_status
from ..receipts import HEADER as RECEIPT_HEADER, header_asks, receipts_of
from ..requests import ValidatedRequest, admit, build
from ..responses_store import ResponseStore
from ..state import ServerState
from ..tenancy import current as current_tenant
from .inputs import client_request_id, find_surrogate, read_json, validated
from .responses import ResponsesRequest, responses_spec
from .responses_format import EventWriter, ResponseBuilder, conversation_output, sse
from .sse import SSEStream, collect_events, joined


def prepare(state: ServerState, store: ResponseStore, body: Any, request_id: str, receipt_header: bool = False,
            owner: str = "") -> tuple[ValidatedRequest, ResponsesRequest, list[dict[str, Any]]]:
    """Parse and validate (requests.build), for the tokenizer thread; `owner` is the caller's tenant, whose
    stored responses alone it may continue. Raises Refused, named as this API names its fields (text.format,
    input)."""
    bad = find_surrogate(body)
    if bad is not None:
        raise Refused("invalid_unicode", f"{bad}: contains an unpaired UTF-16 surrogate escape; not valid Unicode",
                      bad)
    parsed = validated(ResponsesRequest, body)
    spec, conversation = responses_spec(store, body, request_id, parsed, owner)
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
        owner = tenant_name()
        req, parsed, conversation = await state.run_tokenizer(prepare, state, store, body,
                                                              client_request_id(request.scope),
                                                              header_asks(request.headers.get(RECEIPT_HEADER)),
                                                              owner)
        channel = admit(state, req)
        builder = ResponseBuilder("resp_" + uuid.uuid4().hex, req.request_id, state.model_name,
                                  str(state.fingerprint), parsed, req.tool_format)
        keep = store if parsed.store else None
        receipt = receipts_of(state, req)
        if parsed.stream:
            return SSEStream(channel, ResponsesEncoder(builder, keep, conversation, receipt, owner),
                             cfg.stall_timeout)
        events = await collect_events(request.receive, channel)
        if isinstance(events, Response):
            return events
        out = builder.final(events.accs[0])
        if receipt is not None:
            out["receipt"] = receipt(0, events.accs[0])
        if keep is not None:
            keep.put(out, conversation + conversation_output(out), owner)
        return JSONResponse(out)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        """A stored response, as POST /v1/responses returned it; 404 when it is not (or no longer) stored, or
        another tenant made it."""
        return JSONResponse(store.get(response_id, None, tenant_name()).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        """Forget a stored response: `{"id", "object": "response", "deleted": true}`; 404 when it is not stored."""
        store.delete(response_id, tenant_name())
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def tenant_name() -> str:
    """The caller's tenant (api/tenancy.py), whose stored responses it sees; "" on a server without keys."""
    tenant = current_tenant()
    return tenant.name if tenant is not None else ""


class ResponsesEncoder:
    """A streamed response's events as the Responses API names them (responses_format.py), for SSEStream; the
    finished response is kept in the store (with store: true)."""

    def __init__(self, builder: ResponseBuilder, store: ResponseStore | None, conversation: list[dict[str, Any]],
                 receipt: Callable[[int, Accumulated], dict[str, Any]] | None = None, owner: str = "") -> None:
        self.writer = EventWriter(builder)
        self.owner = owner  # the tenant the stored response belongs to
        self.store = store  # where the finished response is kept; None with store: false
        self.conversation = conversation
        self.receipt = receipt  # api/receipts.py: set when the request asked for one

    def _sse(self, evs: list[dict[str, Any]]) -> list[bytes]:
        return joined([sse(e) for e in evs])

    def start(self) -> list[bytes]:
        return self._sse(self.writer.start())

    def event(self, ev: Event, channel: RequestChannel) -> list[bytes]:
        return self._sse(self.writer.feed(ev.text, ev.finished))

    def error(self, ev: Event) -> list[bytes]:
        code, message = ev.error  # type: ignore[misc]  # error events carry one
        w = self.writer
        return self._sse(w.feed("".join(o.text_delta for o in ev.outputs[:-1]), False)) + self._sse(
            [w.event("error", code=code, message=message, param=None, error_type=end_status(code).error_type)])

    def finish(self, channel: RequestChannel) -> list[bytes]:
        closing, body = self.writer.finish(channel.accs[0])
        if self.receipt is not None:  # in response.completed's response object (the same dict)
            body["receipt"] = self.receipt(0, channel.accs[0])
        if self.store is not None:
            self.store.put(body, self.conversation + conversation_output(body), self.owner)
        return self._sse(closing)
