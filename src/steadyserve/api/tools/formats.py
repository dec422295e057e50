"""How one model writes function calls: the grammar that constrains them, where they start in the output,
how a conversation with calls is rendered, and how calls are parsed back.

A format is chosen from the model's chat template (select.py's `format_for`): a template that writes Hermes/Qwen
`<tool_call>` blocks gets the Hermes format, a Llama 3 template its JSON calls, and any other (SmolLM2's
default among them) the generic format, which describes the tools in the system prompt. Every format's
calls are JSON objects with the function's name and an arguments object, so one grammar shape serves all:

    calls: PREFIX call (SEP call)* SUFFIX        (one call when parallel_tool_calls is false)
    call:  OPEN %json{the call objects' schemas} CLOSE
    start: calls                                 (tool_choice required or a named function)
    start: calls | text                          (auto: a text answer may start with anything but the
                                                  first character of a call, blanks aside)

The arguments are produced by constrained decoding (llguidance), so under `required` and a named function
they always parse and validate against the tool's schema; under `auto` a call the model starts with is held
to the schema too, and a text answer is free apart from its first character. (Hermes blocks that follow
text under `auto` are parsed, but were not constrained.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .scan import scan_calls
from .spec import Tool, ToolRequest, arguments_object


@dataclass(frozen=True)
class ParsedOutput:
    """A finished (or cut) output split into text and calls."""

    content: str | None  # text outside the calls, surrounding whitespace stripped; None when there is none
    calls: list[tuple[str, str]]  # (function name, raw arguments JSON) in order


@dataclass(frozen=True)
class Region:
    """Where an output stands so far: how much of it is surely text, and where its calls begin."""

    content_end: int  # text before this offset is content (a possible start of a call is held back)
    calls_start: int | None  # offset of the first call's first character; None: no call (yet)


class ToolFormat:
    """The generic shape; the formats (generic.py, hermes.py, llama3.py) set its literals."""

    name = "base"
    native = True  # the chat template renders tools and calls itself
    prefix = ""  # before the first call
    suffix = ""  # after the last call
    open = ""  # before each call
    close = ""  # after each call
    sep = ""  # between calls
    args_key = "arguments"  # the call object's key that holds the arguments
    call_depth = 1  # nesting depth of the call objects in the calls text
    first_char = "{"  # what a call starts with; a text answer under auto may not start with it

    @staticmethod
    def matches(template: str) -> bool:
        """Whether a chat template writes calls in this format."""
        return False

    # ---- decoding -------------------------------------------------------------------------------------------
    def call_schema(self, tool: Tool) -> dict[str, Any]:
        return {"type": "object", "properties": {"name": {"const": tool.name}, self.args_key: tool.parameters},
                "required": ["name", self.args_key], "additionalProperties": False}

    def grammar(self, req: ToolRequest) -> str:
        """The llguidance (lark) grammar of this request's output."""
        schemas = [self.call_schema(t) for t in req.callable]
        obj = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        # Compact JSON, as response_format: a small model cannot wander into endless whitespace.
        obj = {**obj, "x-guidance": {"whitespace_flexible": False}}
        call = " ".join(x for x in (_lit(self.open), "%json " + json.dumps(obj), _lit(self.close)) if x)
        more = f"({_lit(self.sep)} call)*" if req.parallel else ""
        calls = " ".join(x for x in (_lit(self.prefix), "call", more, _lit(self.suffix)) if x)
        lines = [f"call: {call}", f"calls: {calls}"]
        if req.forced:
            lines.insert(0, "start: calls")
        else:
            first = self.first_char.replace("\\", "\\\\").replace("/", "\\/").replace("]", "\\]")
            # Blanks may come first, then anything but a call's first character: " {" cannot sneak a call
            # past the grammar (the parser skips leading blanks).
            lines = ["start: calls | text", *lines, f"text: /\\s*[^{first}\\s](.|\\n)*/"]
        return "\n".join(lines) + "\n"

    # ---- reading the output ---------------------------------------------------------------------------------
    def region(self, text: str) -> Region:
        """Generic and Llama 3: the first non-blank character decides: a call, or a text answer."""
        body = text.lstrip()
        if not body:
            return Region(0, None)
        if body.startswith(self.first_char):
            return Region(len(text) - len(body), len(text) - len(body))
        return Region(len(text), None)

    def parse(self, text: str) -> ParsedOutput:
        """The whole output's text and calls: a call whose name is complete counts, even when the output was
        cut (finish_reason length) inside its arguments, as a stream would have sent it."""
        r = self.region(text)
        if r.calls_start is None:
            return ParsedOutput(text.strip(), [])
        calls_text = text[r.calls_start:]
        calls = [(c.name, c.arguments(calls_text)) for c in scan_calls(calls_text, self.call_depth, self.args_key)
                 if c.name is not None]
        return ParsedOutput(text[:r.calls_start].strip() or None, calls)

    # ---- rendering the conversation -------------------------------------------------------------------------
    def template_input(self, messages: list[dict[str, Any]], req: ToolRequest | None
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages and extra keyword arguments for apply_chat_template. A native template gets the tools
        (`tools=`) and assistant calls with their arguments as objects, as Hugging Face templates expect."""
        out = []
        for i, m in enumerate(messages):
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**tc, "function": {**tc["function"], "arguments": arguments_object(
                    tc["function"]["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments")}}
                    for j, tc in enumerate(m["tool_calls"])]
            if m.get("role") == "tool" and "name" not in m:
                m["name"] = call_name(messages, m.get("tool_call_id"))
            out.append(m)
        kwargs = {"tools": [t.as_openai() for t in req.tools]} if req is not None and req.active else {}
        return out, kwargs


def call_name(messages: list[dict[str, Any]], call_id: str | None) -> str:
    """The function name of the earlier assistant call with this id ("" if none names it)."""
    for m in messages:
        for tc in m.get("tool_calls") or []:
            if tc.get("id") == call_id:
                return tc["function"]["name"]
    return ""


def _lit(s: str) -> str:
    """A lark string literal ('' for none)."""
    return json.dumps(s) if s else ""
