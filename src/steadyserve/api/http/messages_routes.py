"""The /v1/messages routes (Anthropic's Messages API): create (whole or streamed) and count_tokens.

A create is parsed and validated on the tokenizer thread (messages.py -> requests.build, the chat path),
admitted like any request, and encoded from its channel (engine/channel.py; streamed through sse.py's
SSEStream with MessagesEncoder): a whole message object, or
Anthropic's server-sent events ending with message_stop, or one `error` event when the stream ends early
(the request failed, the server drained it away). Refusals get Anthropic's error shape
(messages_errors.py; app.py routes this API's refusals there).
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ...limits import InvalidRequest, Refused
from ..events import Accumulated, Event, RequestChannel
from ..protocol import render_chat
from ..requests import ValidatedRequest, admit, build, check_model
from ..state import ServerState
from .inputs import client_request_id, find_surrogate, read_json, validated
from .messages import MessagesRequest, messages_spec
from .messages_errors import MESSAGES_PATH, anthropic_end_error
from .messages_format import EventWriter, MessageBuilder, sse
from .sse import SSEStream, http_disconnect, joined

def parse(body: Any, request_id: str) -> tuple[MessagesRequest, Any]:
    """The body through its model, and its chat RequestSpec. Raises Refused."""
    bad = find_surrogate(body)
    if bad is not None:
        raise Refused("invalid_unicode", f"{bad}: contains an unpaired UTF-16 surrogate escape; not valid Unicode",
                      bad)
    parsed = validated(MessagesRequest, body)
    return parsed, messages_spec(body, parsed, request_id)


def prepare(state: ServerState, body: Any, request_id: str) -> tuple[ValidatedRequest, MessagesRequest]:
    """Parse and validate (requests.build), for the tokenizer thread. Raises Refused, named as this API names
    its fields (stop_sequences, output_config.format)."""
    parsed, spec = parse(body, request_id)
    try:
        return build(state, spec), parsed
    except InvalidRequest as e:
        for ours, theirs in (("stop", "stop_sequences"), ("response_format", "output_config.format")):
            if e.param == ours:
                raise InvalidRequest(theirs, e.message_for(theirs)) from None
        raise


def stop_finder(state: ServerState, stops: list[str]) -> Any:
    """The stop sequence that ended a finished turn, or None when it ended on end-of-sequence (or no stop
    sequence was sent). The engine cuts the text before the first stop string it finds, so the stop sequence
    is the one that starts where the text ends, in the decoded tokens (decoded as the detokenizer decodes)."""
    eos = state.limits.eos_token_ids
    tok = state.loaded.tokenizer

    def matched(acc: Accumulated) -> str | None:
        if not stops or acc.finish_reason != "stop" or not acc.token_ids or acc.token_ids[-1] in eos:
            return None
        full = tok.decode(acc.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        found = sorted((i, -len(s), s) for i, s in ((full.find(s), s) for s in stops) if i >= 0)
        return found[0][2] if found else stops[0]

    return matched


def add_messages_routes(app: FastAPI, state: ServerState) -> None:
    cfg = state.config.server

    @app.post(MESSAGES_PATH)
    async def create_message(request: Request) -> Response:
        """Anthropic's Messages API: `system`, `messages` (text, tool_use and tool_result blocks), `max_tokens`
        (required), `stop_sequences`, `temperature`, `top_p`, `top_k`, custom `tools` and `tool_choice`;
        streamed as Anthropic's events with `stream: true`. Errors in Anthropic's shape
        (`{"type": "error", "error": {"type", "message"}}`); 429 rate_limit_error with retry-after at capacity,
        529 overloaded_error while draining. The API key may come as `x-api-key` or `Authorization: Bearer`."""
        body = await read_json(request, cfg.max_request_bytes)
        req, parsed = await state.run_tokenizer(prepare, state, body, client_request_id(request.scope))
        builder = MessageBuilder("msg_" + uuid.uuid4().hex, req.request_id, state.model_name, req.tool_format,
                                 stop_finder(state, req.params[0].stop))
        channel = admit(state, req)
        if parsed.stream:
            return SSEStream(channel, MessagesEncoder(builder, len(req.prompts[0])), cfg.stall_timeout)
        await channel.watch(disconnected=http_disconnect(request.receive)).drain()
        if channel.error is not None:  # the request failed: its end code's status, in Anthropic's shape
            status, err = anthropic_end_error(*channel.error)
            return JSONResponse(err, status_code=status)
        return JSONResponse(builder.final(channel.accs[0]))

    @app.post(MESSAGES_PATH + "/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Anthropic's token counting: the same body (without max_tokens) rendered as /v1/messages renders it,
        answered `{"input_tokens": N}`."""
        body = await read_json(request, cfg.max_request_bytes)
        n = await state.run_tokenizer(count, state, body)
        return JSONResponse({"input_tokens": n})


def count(state: ServerState, body: Any) -> int:
    """Tokens of a Messages body's prompt (tools included, as offered). Raises Refused."""
    if isinstance(body, dict) and "max_tokens" not in body:
        body = {**body, "max_tokens": 1}
    if isinstance(body, dict) and body.get("stream"):
        raise InvalidRequest("stream", "stream: count_tokens answers at once; leave it out")
    _, spec = parse(body, "")
    check_model(state, spec.model)
    tools = spec.tools if spec.tools is not None and spec.tools.active else None
    return len(render_chat(state.loaded.tokenizer, spec.messages or [], tools, spec.continue_final))


class MessagesEncoder:
    """A streamed message's events as Anthropic names them (messages_format.py), for SSEStream."""

    def __init__(self, builder: MessageBuilder, input_tokens: int) -> None:
        self.writer = EventWriter(builder)
        self.input_tokens = input_tokens  # the rendered prompt's length, known before the first step

    def _sse(self, evs: list[dict[str, Any]]) -> list[bytes]:
        return joined([sse(e) for e in evs])

    def start(self) -> list[bytes]:
        return self._sse(self.writer.start(self.input_tokens))

    def event(self, ev: Event, channel: RequestChannel) -> list[bytes]:
        return self._sse(self.writer.feed(ev.text, ev.finished))

    def error(self, ev: Event) -> list[bytes]:
        _, body = anthropic_end_error(*ev.error)  # type: ignore[misc]  # error events carry one
        return self._sse(self.writer.feed("".join(o.text_delta for o in ev.outputs[:-1]), False)) + self._sse([body])

    def finish(self, channel: RequestChannel) -> list[bytes]:
        return self._sse(self.writer.finish(channel.accs[0]))
