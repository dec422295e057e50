"""Tools as a request states them, validated once for every transport: `tools`, `tool_choice` and
`parallel_tool_calls` of chat completions (and, flattened, of the Responses API and gRPC).

Only function tools exist here, as in OpenAI's chat API. A tool's `parameters` is a JSON schema that
constrained decoding follows (engine/structured.py); one this model's grammar compiler cannot compile is
refused naming the tool (`tools[1].function.parameters`), never a 500.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ...limits import InvalidRequest

MAX_TOOLS = 128  # OpenAI's limit on tools per request
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str  # the function's name: 1-64 of [A-Za-z0-9_-], unique in the request
    description: str  # what it does, shown to the model in the prompt ("" if none)
    parameters: dict[str, Any]  # JSON schema of its arguments ({"type": "object"} when the client sent none)

    def as_openai(self) -> dict[str, Any]:
        """The chat API's shape, which chat templates that know tools take (`tools=` of apply_chat_template)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """Which calls the model may make."""

    mode: str  # none: text only | auto: the model chooses | required: at least one call | function: `name` only
    name: str | None = None  # with mode "function": the function it must call


@dataclass(frozen=True)
class ToolRequest:
    """The tool fields of one request, validated (RequestSpec.tools)."""

    tools: tuple[Tool, ...]  # in the order sent: tool_calls name them, the prompt lists them in this order
    choice: ToolChoice  # tool_choice; "auto" when tools are sent without it, as OpenAI defaults
    parallel: bool = True  # parallel_tool_calls: more than one call per turn (OpenAI's default: true)
    schema_param: str = "tools[{i}].function.parameters"  # how refusals name tool i's schema (Responses: flat)

    @property
    def active(self) -> bool:
        """Whether the model is offered the tools at all (tool_choice none: it answers in text)."""
        return bool(self.tools) and self.choice.mode != "none"

    @property
    def callable(self) -> tuple[Tool, ...]:
        """The tools the model may call under the choice: one for a named function, else all."""
        if self.choice.mode == "function":
            return tuple(t for t in self.tools if t.name == self.choice.name)
        return self.tools

    @property
    def forced(self) -> bool:
        """required or a named function: the output is calls only, their arguments by constrained decoding."""
        return self.choice.mode in ("required", "function")


def parse_tool(item: Any, param: str) -> Tool:
    """One `{"type": "function", "function": {"name", "description", "parameters"}}`. Raises InvalidRequest."""
    if not isinstance(item, dict):
        raise InvalidRequest(param, f"{param} must be an object")
    if item.get("type", "function") != "function":
        raise InvalidRequest(f"{param}.type", f"{param}.type: only function tools are supported, not "
                             f"{item.get('type')!r}")
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequest(f"{param}.function", f"{param}.function must be an object with a name")
    return tool_from_fields(fn, f"{param}.function")


def tool_from_fields(fn: dict[str, Any], param: str) -> Tool:
    """A Tool from {name, description, parameters} (the chat API's `function`, or a Responses tool)."""
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest(f"{param}.name", f"{param}.name must be 1-64 letters, digits, _ or -")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise InvalidRequest(f"{param}.description", f"{param}.description must be a string")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object"}
    if not isinstance(params, dict):
        raise InvalidRequest(f"{param}.parameters", f"{param}.parameters must be a JSON schema object")
    return Tool(name, desc, params)


def parse_tool_choice(value: Any, names: set[str], param: str = "tool_choice") -> ToolChoice | None:
    """tool_choice as sent: "none" | "auto" | "required" | {"type": "function", "function": {"name"}} (the
    Responses API's {"type": "function", "name"} too). None when absent. Raises InvalidRequest."""
    if value is None:
        return None
    if isinstance(value, str):
        if value not in CHOICE_MODES:
            raise InvalidRequest(param, f"{param} must be one of none, auto, required or a function, not {value!r}")
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function") if isinstance(value.get("function"), dict) else value
        name = fn.get("name")
        if name not in names:
            raise InvalidRequest(param, f"{param}: no tool named {name!r} in tools")
        return ToolChoice("function", name)
    raise InvalidRequest(param, f'{param} must be "none", "auto", "required" or {{"type": "function", '
                         '"function": {"name": ...}}')


def tool_request(tools: list[Tool], choice: ToolChoice | None, parallel: bool | None,
                 choice_param: str = "tool_choice", schema_param: str = "tools[{i}].function.parameters"
                 ) -> ToolRequest | None:
    """The request's ToolRequest, or None when it sends no tools (a tool_choice other than none then refused)."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest("tools", f"tools: at most {MAX_TOOLS} tools per request")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise InvalidRequest(f"tools[{i}]", f"tools[{i}]: two tools are named {t.name!r}")
        seen.add(t.name)
    if not tools:
        if choice is not None and choice.mode != "none":
            raise InvalidRequest(choice_param, f"{choice_param} needs tools")
        return None
    return ToolRequest(tuple(tools), choice or ToolChoice("auto"), True if parallel is None else parallel,
                       schema_param)


def arguments_object(raw: Any, param: str) -> Any:
    """A call's `arguments` (a JSON string, as OpenAI sends it) as the value chat templates render."""
    if isinstance(raw, (dict, list)):
        return raw
    if not isinstance(raw, str):
        raise InvalidRequest(param, f"{param} must be a JSON string")
    try:
        return json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise InvalidRequest(param, f"{param} is not valid JSON") from None
