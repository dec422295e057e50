"""HTTP request input: bodies read within limits, pydantic errors named by field, and a completion or chat
body as the transport-neutral RequestSpec that requests.build validates for every transport.

Shared by the HTTP routes (app.py) and the WebSocket (ws.py).
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect
from pydantic import BaseModel, ValidationError

from ...limits import DEFAULT_MAX_TOKENS, Refused
from .. import json_input
from ..requests import OutputOptions, RequestSpec, ValidatedRequest, build
from ..state import ServerState
from .schemas import ChatCompletionRequest, CompletionRequest, refuse_unsupported

M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refusing oversize bodies, invalid UTF-8 and malformed JSON by name."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise Refused("request_too_large", f"request body exceeds {limit} bytes (--max-request-bytes)")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or cut off by --body-timeout (http/edge.py answered it 408): no one to answer
        raise Refused("client_disconnect", "the client went away before its request body was complete") from None
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Refused("invalid_utf8", f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json_input.loads(text)
    except json.JSONDecodeError as e:
        raise Refused("invalid_json", f"request body is not valid JSON: {e.msg} at line {e.lineno} column "
                      f"{e.colno}") from None
    if not isinstance(body, dict):
        raise Refused("invalid_json", "request body must be a JSON object")
    return body


_SURROGATE = re.compile("[\ud800-\udfff]")


def find_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string holding an unpaired UTF-16 surrogate (JSON's "\\ud800"), else None."""
    if isinstance(value, str):
        return path or "body" if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)  # type: ignore[assignment]
    else:
        return None
    for k, v in items:
        if isinstance(k, str) and _SURROGATE.search(k):
            return f"{path}.{k}".lstrip(".") if path else "body"
        found = find_surrogate(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}".lstrip("."))
        if found:
            return found
    return None


def parse_body(body: Any, kind: str) -> CompletionRequest | ChatCompletionRequest:
    """A completion or chat body through its pydantic model. Raises Refused naming the field."""
    bad = find_surrogate(body)
    if bad is not None:
        raise Refused("invalid_unicode", f"{bad}: contains an unpaired UTF-16 surrogate escape; not valid Unicode",
                      bad)
    refuse_unsupported(body)
    return validated(ChatCompletionRequest if kind == "chat" else CompletionRequest, body)


def request_spec(body: Any, kind: str, transport: str, request_id: str, receipt_header: bool = False) -> RequestSpec:
    """An HTTP or WebSocket body as the transport-neutral RequestSpec (`receipt_header`: the request's
    x-steadyserve-receipt header asked for a receipt). Raises Refused."""
    req = parse_body(body, kind)
    try:
        params = req.sampling_params(DEFAULT_MAX_TOKENS[kind])  # max_tokens: requests.build decides
    except Refused:
        raise
    except (ValueError, TypeError) as e:  # a response_format schema the grammar compiler refuses
        raise Refused("invalid_value", str(e), getattr(e, "param", None)) from None
    chat = isinstance(req, ChatCompletionRequest)
    return RequestSpec(
        kind=kind, transport=transport, request_id=request_id, model=req.model, params=params,
        prompts=[] if chat else req.prompt_list(), messages=req.message_dicts() if chat else None,
        requested_max_tokens=req.requested_max_tokens,
        max_tokens_param="max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None
        else "max_tokens", num_samples=req.num_samples, n=req.n, stream=req.stream, output=output_options(req),
        tools=req.tool_request() if chat else None, receipt=req.receipt or receipt_header, reads_harmony=chat)


def output_options(req: CompletionRequest | ChatCompletionRequest) -> OutputOptions:
    """The encoders' options, as the body states them (completions: `logprobs: N`; chat: `logprobs: true` and
    `top_logprobs`)."""
    usage = bool(req.stream_options and req.stream_options.include_usage)
    if isinstance(req, ChatCompletionRequest):
        return OutputOptions(logprobs=req.logprobs, top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
                             include_usage=usage)
    return OutputOptions(logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0, echo=req.echo,
                         include_usage=usage)


def client_request_id(scope: dict) -> str:
    """The request id the client sent (x-request-id), even one the envelope replaced for being invalid, so that
    requests.build refuses it; else the envelope's."""
    st = scope.get("state", {})
    return st.get("refused_request_id") or st["request_id"]


def validated(model: type[M], body: Any) -> M:
    """`body` through a pydantic model; a failure is refused naming the field (validation_refusal). Every HTTP and
    WebSocket body passes here."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_refusal(e) from None


def validation_refusal(e: ValidationError) -> Refused:
    """The refusal of a body its model did not validate. A top-level field the model does not know
    (schemas.RequestBody) comes first, as OpenAI refuses it: code `unknown_field`, every such field named, `param`
    the first. Else `invalid_value` with the first error's field (validation_message)."""
    unknown = [str(err["loc"][0]) for err in e.errors()
               if err.get("type") == "extra_forbidden" and len(err.get("loc", ())) == 1]
    if unknown:
        s = "s" if len(unknown) > 1 else ""
        return Refused("unknown_field", f"Unrecognized request argument{s} supplied: {', '.join(unknown)}", unknown[0])
    msg, param = validation_message(e)
    return Refused("invalid_value", msg, param)


def build_from_body(state: ServerState, body: Any, kind: str, transport: str, request_id: str,
                    receipt_header: bool = False) -> ValidatedRequest:
    """Parse and validate in one call, for the tokenizer thread. Raises Refused."""
    return build(state, request_spec(body, kind, transport, request_id, receipt_header))


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        msg = "field required"
    return (f"{loc}: {msg}" if loc else msg), (loc or None)
