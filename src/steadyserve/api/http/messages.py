"""POST /v1/messages, Anthropic's Messages API: its body, and its conversation as the chat RequestSpec that
requests.build validates for every endpoint, so a Messages request is a chat request in another shape.

`system` (a string or text blocks) becomes the system message; `messages` with text, `tool_use` and
`tool_result` blocks become chat messages in OpenAI's shapes (an assistant's tool_use blocks its
`tool_calls`, each tool_result a `tool` message answering its call), which the model's chat template and
tool format (api/tools) render exactly as they render OpenAI tool calls. Custom `tools` (`input_schema`) and
`tool_choice` (auto, any, tool, none) map onto the chat tools, held to their schemas by the same constrained
decoding. What this server cannot do is refused by name: image and document blocks, extended thinking,
server tools, an effort level. A final assistant message is a prefill: the answer continues it (and does not
repeat it). `cache_control` is accepted and ignored (the prefix cache is
automatic), as are `metadata.user_id` and the fields of Anthropic's own service (IGNORED). `output_config.format`
(a JSON schema) is the chat API's json_schema response_format. The response and stream are messages_format.py's.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import Field, StrictBool, StrictInt

from ...engine.sequence import SamplingParams
from ...limits import MAX_TEMPERATURE, InvalidRequest
from ..requests import OutputOptions, RequestSpec
from ..tools import ToolChoice, ToolRequest, tool_from_fields, tool_request
from .schemas import Number, RequestBody, grammar_for, shared_range

# Anthropic's request fields that would change the result and that steadyserve does not implement: refused by
# name when set (`thinking` also passes as {"type": "disabled"}, which asks for nothing).
UNSUPPORTED = {"thinking": "extended thinking is not supported by this model",
               "container": "containers (code execution) are not supported",
               "mcp_servers": "MCP servers are not supported: run the tools in the client and send tool_result blocks",
               "context_management": "context management is not supported"}
# Anthropic's fields that cannot change the result here: accepted without effect (one tier, one region, one
# speed, no workspaces; top-level cache_control marks a prefix for caching, which the prefix cache does for every
# prompt unmarked; diagnostics only asks for a cache-miss explanation in the response).
IGNORED = frozenset({"service_tier", "cache_control", "inference_geo", "speed", "user_profile_id", "workspace_id",
                     "diagnostics"})
BLOCK_HINT = "text, tool_use and tool_result blocks are supported"
REFUSED_BLOCKS = {"image": "image blocks are not supported: this server serves text-only models",
                  "document": "document blocks are not supported: send the text as text blocks",
                  "thinking": "thinking blocks are not supported (no extended thinking)",
                  "redacted_thinking": "thinking blocks are not supported (no extended thinking)"}


class MessagesRequest(RequestBody):
    """Body of POST /v1/messages."""
    accepted_unused: ClassVar[frozenset[str]] = IGNORED | set(UNSUPPORTED)

    model: str | None = Field(default=None, description="the served model's id (GET /v1/models, or "
                              "--served-model-name); any other is a 404 not_found_error")
    messages: list[dict[str, Any]] = Field(description='the conversation: {"role": "user" | "assistant", '
                                           '"content": a string or blocks}; blocks: text, tool_use (assistant), '
                                           'tool_result (user)', json_schema_extra={"minItems": 1})
    max_tokens: StrictInt = Field(description="most tokens to generate (required, as Anthropic requires it); at "
                                  "least 1, at most --max-tokens-cap", json_schema_extra=shared_range(1))
    system: str | list[dict[str, Any]] | None = Field(default=None, description="the system prompt: a string or "
                                                      "text blocks")
    stop_sequences: list[str] | None = Field(default=None, description="strings that end the turn (stop_reason "
                                             "stop_sequence); the text stops before them")
    temperature: Number = Field(default=1.0, description="sampling temperature; 0 is greedy",
                                json_schema_extra=shared_range(0.0, MAX_TEMPERATURE))
    top_p: Number | None = Field(default=None, description="nucleus sampling mass",
                                 json_schema_extra=shared_range(None, 1.0, 0.0))
    top_k: StrictInt | None = Field(default=None, description="sample from the k most likely tokens only",
                                    json_schema_extra=shared_range(0))
    metadata: dict[str, Any] | None = Field(default=None, description='{"user_id": ...}: accepted, no effect')
    stream: StrictBool = Field(default=False, description="send Anthropic's server-sent events (message_start "
                               "... message_stop)")
    tools: list[dict[str, Any]] | None = Field(default=None, description='custom tools: [{"name", "description", '
                                               '"input_schema": JSON schema}]; a tool_use block\'s input follows '
                                               'its schema by constrained decoding')
    tool_choice: dict[str, Any] | None = Field(default=None, description='{"type": "auto" | "any" | "none"} or '
                                               '{"type": "tool", "name"}; "disable_parallel_tool_use": true '
                                               'allows at most one call')
    output_config: dict[str, Any] | None = Field(default=None, description='{"format": {"type": "json_schema", '
                                                 '"schema": {...}}}: the text follows the schema (constrained '
                                                 'decoding); an effort level is refused')


def refuse_unsupported(body: dict[str, Any]) -> None:
    for name, why in UNSUPPORTED.items():
        value = body.get(name)
        if value is None or (name == "thinking" and value == {"type": "disabled"}):
            continue
        raise InvalidRequest(name, f"{name}: {why}; leave it out")


def output_grammar(config: dict[str, Any] | None) -> str | None:
    """output_config: its format as the chat API's json_schema response_format (the same grammar); an effort
    level (a reasoning budget) is refused by name."""
    if not config:
        return None
    for key, value in config.items():
        if key == "effort" and value is not None:
            raise InvalidRequest("output_config.effort", "output_config.effort: effort levels are not supported by "
                                 "this model; leave it out")
        if key not in ("effort", "format"):
            raise InvalidRequest(f"output_config.{key}", f"output_config.{key}: unknown field (format, effort)")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest("output_config.format", 'output_config.format must be {"type": "json_schema", '
                             '"schema": {...}}')
    try:
        return grammar_for({"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}})
    except (ValueError, TypeError) as e:  # a schema the grammar compiler refuses
        raise InvalidRequest("output_config.format", f"output_config.format: {e}") from None


def check_metadata(metadata: dict[str, Any] | None) -> None:
    """Anthropic's metadata has one key, user_id (a string or null), which changes nothing here."""
    for key, value in (metadata or {}).items():
        if key != "user_id":
            raise InvalidRequest(f"metadata.{key}", f"metadata.{key}: unknown field (metadata has user_id only)")
        if value is not None and not isinstance(value, str):
            raise InvalidRequest("metadata.user_id", "metadata.user_id must be a string")


def text_of(blocks: Any, param: str) -> str:
    """A string, or text blocks joined (system, a tool_result's content)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise InvalidRequest(param, f"{param} must be a string or a list of text blocks")
    out = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text" or not isinstance(b.get("text"), str):
            why = REFUSED_BLOCKS.get(kind, "only text blocks are supported here") if isinstance(kind, str) else \
                'a block is {"type": "text", "text": ...}'
            raise InvalidRequest(f"{param}[{j}]", f"{param}[{j}]: {why}")
        out.append(b["text"])
    return "".join(out)


def block_kind(block: Any, param: str, allowed: tuple[str, ...]) -> str:
    """A content block's type, refused by name where this server cannot take it."""
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise InvalidRequest(f"{param}.type", f"{param}.type: a content block is an object with a type")
    if kind in allowed:
        return kind
    why = REFUSED_BLOCKS.get(kind) or f"{kind} blocks are not supported in this message ({BLOCK_HINT})"
    raise InvalidRequest(f"{param}.type", f"{param}.type: {why}")


def block_text(block: dict[str, Any], param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidRequest(f"{param}.text", f"{param}.text must be a string")
    return block["text"]


def assistant_message(content: list[Any], param: str) -> dict[str, Any]:
    """An assistant turn: its text, and its tool_use blocks as OpenAI tool_calls (arguments: the input as JSON)."""
    texts, calls = [], []
    for j, b in enumerate(content):
        p = f"{param}[{j}]"
        if block_kind(b, p, ("text", "tool_use")) == "text":
            texts.append(block_text(b, p))
            continue
        for key in ("id", "name"):
            if not isinstance(b.get(key), str) or not b[key]:
                raise InvalidRequest(f"{p}.{key}", f"{p}.{key} must be a non-empty string")
        if not isinstance(b.get("input"), dict):
            raise InvalidRequest(f"{p}.input", f"{p}.input must be an object")
        calls.append({"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def user_messages(content: list[Any], param: str, call_ids: set[str]) -> list[dict[str, Any]]:
    """A user turn: each tool_result a `tool` message answering its call (of the assistant turn before), text
    blocks a user message, in the order sent."""
    out: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        p = f"{param}[{j}]"
        if block_kind(b, p, ("text", "tool_result")) == "text":
            text = block_text(b, p)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += text
            else:
                out.append({"role": "user", "content": text})
            continue
        tid = b.get("tool_use_id")
        if not isinstance(tid, str):
            raise InvalidRequest(f"{p}.tool_use_id", f"{p}.tool_use_id must be a string")
        if tid not in call_ids:
            raise InvalidRequest(f"{p}.tool_use_id", f"{p}.tool_use_id: no tool_use block with id {tid!r} in the "
                                 "assistant message before it")
        is_error = b.get("is_error", False)
        if not isinstance(is_error, bool):
            raise InvalidRequest(f"{p}.is_error", f"{p}.is_error must be a boolean")
        result = text_of(b.get("content", ""), f"{p}.content")
        out.append({"role": "tool", "tool_call_id": tid, "content": f"Error: {result}" if is_error else result})
    return out


def conversation(system: str | list[dict[str, Any]] | None, messages: list[Any]) -> list[dict[str, Any]]:
    """`system` and `messages` as chat messages in OpenAI's shapes. Raises InvalidRequest naming the block."""
    out: list[dict[str, Any]] = []
    if system is not None:
        text = text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not messages:
        raise InvalidRequest("messages", "messages must not be empty")
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(param, f'{param} must be an object {{"role", "content"}}')
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise InvalidRequest(f"{param}.role", f"{param}.role must be user or assistant (the system prompt is "
                                 "the top-level system field)")
        if not isinstance(content, (str, list)) or content == []:
            raise InvalidRequest(f"{param}.content", f"{param}.content must be a string or a non-empty list of "
                                 "blocks")
        if role == "assistant":
            msg = {"role": "assistant", "content": content} if isinstance(content, str) else \
                assistant_message(content, f"{param}.content")
            call_ids = {c["id"] for c in msg.get("tool_calls", [])}
            out.append(msg)
        else:
            out += [{"role": "user", "content": content}] if isinstance(content, str) else \
                user_messages(content, f"{param}.content", call_ids)
            call_ids = set()
    last = out[-1]
    if last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
        i = len(messages) - 1
        raise InvalidRequest(f"messages[{i}].content", f"messages[{i}].content: a final assistant message (a "
                             "prefill, which the answer continues) must be text only and not empty")
    return out


def tool_choice_of(value: dict[str, Any] | None, names: set[str]) -> tuple[ToolChoice | None, bool | None]:
    """Anthropic's tool_choice as (the chat ToolChoice, parallel_tool_calls). Raises InvalidRequest."""
    if value is None:
        return None, None
    kind = value.get("type")
    modes = {"auto": "auto", "any": "required", "none": "none", "tool": "function"}
    if not isinstance(kind, str) or kind not in modes:  # a list or an object is not a mode (nor hashable)
        raise InvalidRequest("tool_choice.type", 'tool_choice.type must be "auto", "any", "tool" or "none"')
    name = value.get("name")
    if kind == "tool" and (not isinstance(name, str) or name not in names):
        raise InvalidRequest("tool_choice.name", f"tool_choice.name: no tool named {name!r} in tools")
    disable = value.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise InvalidRequest("tool_choice.disable_parallel_tool_use",
                             "tool_choice.disable_parallel_tool_use must be a boolean")
    return ToolChoice(modes[kind], name if kind == "tool" else None), (None if disable is None else not disable)


def tools_of(req: MessagesRequest) -> ToolRequest | None:
    """Custom tools as the chat tools; server tools (a type other than custom) refused by name."""
    tools = []
    for i, t in enumerate(req.tools or []):
        param = f"tools[{i}]"
        if not isinstance(t, dict):
            raise InvalidRequest(param, f"{param} must be an object")
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise InvalidRequest(f"{param}.type", f"{param}.type: server tools ({kind!r}) are not supported; only "
                                 "custom tools (name, description, input_schema)")
        if not isinstance(t.get("input_schema"), dict):
            raise InvalidRequest(f"{param}.input_schema", f"{param}.input_schema: required, a JSON schema object")
        tools.append(tool_from_fields({"name": t.get("name"), "description": t.get("description"),
                                       "parameters": t["input_schema"]}, param))
    choice, parallel = tool_choice_of(req.tool_choice, {t.name for t in tools})
    return tool_request(tools, choice, parallel, schema_param="tools[{i}].input_schema")


def messages_spec(body: dict[str, Any], parsed: MessagesRequest, request_id: str) -> RequestSpec:
    """The chat RequestSpec of a Messages body. Raises Refused naming the field as this API names it."""
    refuse_unsupported(body)
    check_metadata(parsed.metadata)
    messages = conversation(parsed.system, parsed.messages)
    params = SamplingParams(temperature=parsed.temperature, top_p=1.0 if parsed.top_p is None else parsed.top_p,
                            top_k=parsed.top_k or 0, stop=list(parsed.stop_sequences or []),
                            grammar=output_grammar(parsed.output_config))
    return RequestSpec(kind="chat", transport="http", request_id=request_id, model=parsed.model, params=params,
                       messages=messages, requested_max_tokens=parsed.max_tokens, stream=parsed.stream,
                       output=OutputOptions(), tools=tools_of(parsed), continue_final=messages[-1]["role"] == "assistant")
