"""POST /v1/responses, the subset agent frameworks use: its body, and its input as the chat RequestSpec that
requests.build validates for every endpoint, so a Responses request is a chat request in another shape.

`input` (a string or message, function_call and function_call_output items) and `instructions` become chat
messages, after the stored conversation of `previous_response_id`; function `tools` (flat:
{"type": "function", "name", "parameters"}), `tool_choice`, `text.format` (json_schema / json_object),
`max_output_tokens`, `temperature` and `top_p` map onto the chat fields. The response object and its stream
events are responses_format.py's.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, StrictBool, StrictInt

from ...engine.sequence import SamplingParams
from ...limits import MAX_TEMPERATURE, InvalidRequest
from ..requests import OutputOptions, RequestSpec
from ..responses_store import ResponseStore
from ..tools import ToolRequest, parse_tool_choice, tool_from_fields, tool_request
from .schemas import IGNORED_FIELDS, Number, RequestBody, grammar_for, shared_range

# Fields of OpenAI's Responses API that would change the result and that steadyserve does not implement.
UNSUPPORTED = {"reasoning": "this model has no reasoning effort", "background": "background responses are not "
               "supported", "conversation": "conversations are not supported: chain with previous_response_id",
               "prompt": "prompt templates are not supported", "max_tool_calls": "max_tool_calls is not supported",
               "top_logprobs": "logprobs are not supported on /v1/responses: use /v1/chat/completions"}
MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(RequestBody):
    """Body of POST /v1/responses."""
    # OpenAI's Responses fields without effect here (stream_options only asks for obfuscation padding), and those
    # refused by value (refuse_unsupported); any other undeclared field is refused as unknown.
    accepted_unused: ClassVar[frozenset[str]] = IGNORED_FIELDS | {"stream_options", *UNSUPPORTED, "truncation",
                                                                  "include"}

    model: str | None = Field(default=None, description="the served model's id; any other is a 404, leaving it "
                              "out means the served model")
    input: str | list[dict[str, Any]] = Field(description="a user message as a string, or a list of items: "
                                              'messages {"role", "content"}, {"type": "function_call", '
                                              '"call_id", "name", "arguments"} and {"type": '
                                              '"function_call_output", "call_id", "output"}')
    instructions: str | None = Field(default=None, description="a system message put first; not carried over "
                                     "by previous_response_id")
    max_output_tokens: StrictInt | None = Field(default=None, description="most tokens to generate (default 512, "
                                                "never more than the context leaves; at most --max-tokens-cap)")
    temperature: Number = Field(default=1.0, description="sampling temperature; 0 is greedy",
                                json_schema_extra=shared_range(0.0, MAX_TEMPERATURE))
    top_p: Number = Field(default=1.0, description="nucleus sampling mass", json_schema_extra=shared_range(None, 1.0,
                                                                                                         0.0))
    text: dict[str, Any] | None = Field(default=None, description='{"format": {"type": "text"}}, {"format": '
                                        '{"type": "json_object"}} or {"format": {"type": "json_schema", "name", '
                                        '"schema"}}: the output follows the schema (constrained decoding)')
    tools: list[dict[str, Any]] | None = Field(default=None, description='function tools: [{"type": "function", '
                                               '"name", "description", "parameters": JSON schema}]')
    tool_choice: str | dict[str, Any] | None = Field(default=None, description='"none", "auto" (the default with '
                                                     'tools), "required" or {"type": "function", "name"}')
    parallel_tool_calls: StrictBool | None = Field(default=None, description="allow more than one call per "
                                                   "response (default true)")
    stream: StrictBool = Field(default=False, description="send the documented server-sent events "
                               "(response.created ... response.completed)")
    store: StrictBool = Field(default=True, description="keep the response for previous_response_id and GET, in "
                              "a bounded in-memory store (oldest evicted first)")
    previous_response_id: str | None = Field(default=None, description="continue the conversation of a stored "
                                             "response: its input and output come before this input")
    metadata: dict[str, str] | None = Field(default=None, description="echoed in the response")
    receipt: StrictBool = Field(default=False, description="return the response's receipt (a stream: in "
                                "response.completed) for `steadyserve verify`; the header x-steadyserve-receipt: 1 "
                                "asks too", json_schema_extra={"x-extension": True})


def refuse_unsupported(body: dict[str, Any]) -> None:
    for name, why in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value is not False:
            raise InvalidRequest(name, f"{name}: {why}; leave it out")
    if body.get("truncation") not in (None, "disabled"):  # dropping earlier input to fit: not done here
        raise InvalidRequest("truncation", 'truncation: only "disabled" is supported (an input over the context '
                             "is refused with too_long)")
    include = body.get("include")
    if include:  # logprobs, encrypted reasoning, search results: none exists here
        raise InvalidRequest("include", "include: no extra output items are supported; leave it out")


def content_text(content: Any, param: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{param}[{j}]", f"{param}[{j}]: only text parts (input_text, output_text) "
                                     "are supported")
            out.append(part["text"])
        return "".join(out)
    raise InvalidRequest(param, f"{param} must be a string or a list of text parts")


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: function calls join the assistant turn before them, outputs become `tool`
    messages answering their call_id."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                raise InvalidRequest(f"input[{i}].role", f"input[{i}].role must be one of {', '.join(MESSAGE_ROLES)}")
            messages.append({"role": role, "content": content_text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise InvalidRequest(f"input[{i}].{key}", f"input[{i}].{key} must be a string")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"input[{i}].call_id", f"input[{i}].call_id must be a string")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": content_text(output, f"input[{i}].output")})
        else:
            raise InvalidRequest(f"input[{i}].type", f"input[{i}].type: {kind!r} items are not supported (message, "
                                 "function_call, function_call_output)")
    if not messages:
        raise InvalidRequest("input", "input must not be empty")
    return messages


def response_format_of(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequest("text.format", "text.format must be an object")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest("text.format", 'text.format: json_schema needs {"type": "json_schema", "name", '
                                 '"schema": {...}}')
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", ""), "schema": fmt["schema"]}}
    return fmt


def tools_of(req: ResponsesRequest) -> ToolRequest | None:
    tools = []
    for i, t in enumerate(req.tools or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise InvalidRequest(f"tools[{i}].type", f"tools[{i}].type: only function tools are supported, not "
                                 f"{kind!r}")
        tools.append(tool_from_fields(t, f"tools[{i}]"))
    choice = parse_tool_choice(req.tool_choice, {t.name for t in tools})
    return tool_request(tools, choice, req.parallel_tool_calls, schema_param="tools[{i}].parameters")


def responses_spec(store: ResponseStore, body: Any, request_id: str, parsed: ResponsesRequest,
                   owner: str = "") -> tuple[RequestSpec, list[dict[str, Any]]]:
    """The chat RequestSpec of a Responses body, and the conversation it continues plus its input (without
    the instructions), which a stored response keeps. Raises Refused (a previous response missing, or
    another tenant's than `owner`: 404)."""
    refuse_unsupported(body)
    before = store.get(parsed.previous_response_id, "previous_response_id", owner).conversation \
        if parsed.previous_response_id else []
    conversation = [*before, *input_messages(parsed.input)]
    messages = ([{"role": "system", "content": parsed.instructions}] if parsed.instructions else []) + conversation
    try:
        grammar = grammar_for(response_format_of(parsed.text))
    except InvalidRequest as e:  # named as this API names it
        raise InvalidRequest("text.format", str(e).replace("response_format", "text.format")) from None
    except (ValueError, TypeError) as e:
        raise InvalidRequest("text.format", f"text.format: {e}") from None
    params = SamplingParams(temperature=parsed.temperature, top_p=parsed.top_p, grammar=grammar)
    spec = RequestSpec(kind="chat", transport="http", request_id=request_id, model=parsed.model, params=params,
                       messages=messages, requested_max_tokens=parsed.max_output_tokens,
                       max_tokens_param="max_output_tokens", stream=parsed.stream, output=OutputOptions(),
                       tools=tools_of(parsed), receipt=parsed.receipt)
    return spec, conversation
