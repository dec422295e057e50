"""Tool (function) calling, transport-neutral: the request's tools (spec.py), the model's call format
(formats.py: generic.py, hermes.py, llama3.py; select.py picks one), the call scanner (scan.py) and the streamed deltas
(stream.py)."""

from .formats import ParsedOutput, ToolFormat
from .select import format_for
from .spec import Tool, ToolChoice, ToolRequest, parse_tool, parse_tool_choice, tool_from_fields, tool_request
from .stream import ToolCallStream, ToolTurn, call_id, tool_calls_json, tool_finish, tool_turn

__all__ = ["ParsedOutput", "Tool", "ToolCallStream", "ToolChoice", "ToolFormat", "ToolRequest", "ToolTurn", "call_id",
           "format_for", "parse_tool", "parse_tool_choice", "tool_calls_json", "tool_finish", "tool_from_fields",
           "tool_request", "tool_turn"]
