"""The generic format, for chat templates that know nothing of tools (SmolLM2's default among them).

As llama.cpp does for such models, the tools are described in the system prompt and a call is a JSON
object the grammar holds to their schemas:

    {"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}

A conversation's earlier calls are rendered as the assistant wrote them (that object), and a tool's result
as a user turn that names the call, since such a template has no `tool` role of its own.
"""

from __future__ import annotations

import json
from typing import Any

from .formats import ToolFormat, call_name
from .spec import ToolRequest, arguments_object

# Short: the prompt is paid for in every request's tokens.
INTRO = "Functions you can call (name, description, JSON schema of the arguments):"
HOW = 'To call functions, reply with only {"tool_calls":[{"name":...,"arguments":{...}}]}; else reply in text.'
HOW_ONE = 'To call a function, reply with only {"tool_calls":[{"name":...,"arguments":{...}}]} (one call); else ' \
    'reply in text.'



class GenericFormat(ToolFormat):
    name = "generic"
    native = False
    prefix = '{"tool_calls":['
    suffix = "]}"
    sep = ","
    call_depth = 3  # the outer object, its array, the call

    @staticmethod
    def matches(template: str) -> bool:
        return True

    def system_prompt(self, req: ToolRequest) -> str:
        listed = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                      separators=(",", ":")) for t in req.tools)
        how = HOW if req.parallel else HOW_ONE
        if req.choice.mode == "required":
            how += " You must call at least one function now."
        elif req.choice.mode == "function":
            how += f" You must call {req.choice.name} now."
        return f"{INTRO}\n{listed}\n{how}"

    def template_input(self, messages: list[dict[str, Any]], req: ToolRequest | None
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            role, content = m["role"], m.get("content") or ""
            if m.get("tool_calls"):
                calls = [{"name": tc["function"]["name"], "arguments": arguments_object(
                    tc["function"]["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments")}
                    for j, tc in enumerate(m["tool_calls"])]
                written = json.dumps({"tool_calls": calls}, separators=(",", ":"), ensure_ascii=False)
                out.append({"role": "assistant", "content": f"{content}\n{written}" if content else written})
            elif role == "tool":
                name = m.get("name") or call_name(messages, m.get("tool_call_id"))
                out.append({"role": "user", "content": f"Result of {name or 'the function'} "
                            f"(call {m.get('tool_call_id')}):\n{content}"})
            else:
                out.append({"role": role, "content": content})
        if req is not None and req.active:
            prompt = self.system_prompt(req)
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out, {}


GENERIC = GenericFormat()
