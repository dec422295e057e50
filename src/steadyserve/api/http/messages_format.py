"""The Messages API's output: the message object, and the server-sent events of a streamed one.

Both read the choice's output through the tool format's parser and ToolCallStream (api/tools), as chat
completions and the Responses API do, and end a turn with the chat finish logic (tools.tool_finish),
so a streamed message's text deltas concatenate to its text block and each tool_use block's input_json_delta
fragments to its input. A stream's events, in the order Anthropic documents them:

    message_start, ping,
    per block:  content_block_start, content_block_delta (text_delta | input_json_delta)..., content_block_stop
    message_delta (stop_reason, stop_sequence, usage), message_stop

An error after the stream started ends it with one `error` event (messages_errors.anthropic_end_error).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from pydantic_core import from_json

from ..events import Accumulated
from ..tools import ParsedOutput, ToolCallStream, ToolFormat, call_id, tool_finish

# The chat finish reason (after tool_finish) -> Anthropic's stop_reason; "stop" is end_turn or stop_sequence.
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def tool_use_id(chat_call_id: str) -> str:
    """A tool_use block's id: the chat call's id (the same request, choice and call give the same one), with
    Anthropic's prefix."""
    return "toolu_" + chat_call_id.removeprefix("call_")


def tool_input(arguments: str) -> Any:
    """A call's arguments as the tool_use block's `input`: the JSON object, or what parses of one cut short by
    max_tokens (as a stream's partial JSON reads)."""
    try:
        return json.loads(arguments)
    except ValueError:
        try:
            value = from_json(arguments, allow_partial=True)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


class MessageBuilder:
    """One message's identity; builds its object, its blocks and its stop reason."""

    def __init__(self, message_id: str, request_id: str, model: str, tool_format: ToolFormat | None,
                 matched_stop: Callable[[Accumulated], str | None]) -> None:
        self.id = message_id  # msg_...
        self.request_id = request_id  # the calls' ids derive from it (as chat's)
        self.model = model
        self.tool_format = tool_format  # None: no tools offered, the output is text
        self.matched_stop = matched_stop  # the stop sequence that ended a finished turn, None for end-of-turn

    def parse(self, text: str) -> ParsedOutput:
        return self.tool_format.parse(text) if self.tool_format is not None else ParsedOutput(text or None, [])

    def stop(self, acc: Accumulated, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of a finished turn."""
        reason = STOP_REASONS.get(tool_finish(acc.finish_reason, called) or "", "end_turn")
        if reason == "end_turn":
            seq = self.matched_stop(acc)
            if seq is not None:
                return "stop_sequence", seq
        return reason, None

    def body(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
             usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def final(self, acc: Accumulated) -> dict[str, Any]:
        """The whole message of a finished turn."""
        parsed = self.parse(acc.text)
        content = [{"type": "text", "text": parsed.content}] if parsed.content else []
        content += [{"type": "tool_use", "id": tool_use_id(call_id(self.request_id, 0, i)), "name": name,
                     "input": tool_input(args)} for i, (name, args) in enumerate(parsed.calls)]
        return self.body(content, self.stop(acc, bool(parsed.calls)),
                         {"input_tokens": acc.num_prompt_tokens, "output_tokens": acc.num_generated_tokens})


class EventWriter:
    """The stream's events for one choice, fed its text as it grows (ToolCallStream splits text and calls)."""

    def __init__(self, builder: MessageBuilder) -> None:
        self.b = builder
        fmt = builder.tool_format
        self.tools = ToolCallStream(fmt, builder.request_id, 0) if fmt is not None else None
        self.blocks = 0  # content blocks started so far; the open one is blocks - 1
        self.open: str | None = None  # the open block's type: text | tool_use | None

    @staticmethod
    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, **fields}

    def start(self, input_tokens: int) -> list[dict[str, Any]]:
        message = self.b.body([], (None, None), {"input_tokens": input_tokens, "output_tokens": 0})
        return [self.event("message_start", message=message), self.event("ping")]

    def feed(self, delta: str, finished: bool) -> list[dict[str, Any]]:
        content, entries = (delta, []) if self.tools is None else self.tools.feed(delta, finished)
        out: list[dict[str, Any]] = []
        if content:
            if self.open != "text":
                out += self._close() + self._open({"type": "text", "text": ""})
            out.append(self.event("content_block_delta", index=self.blocks - 1,
                                  delta={"type": "text_delta", "text": content}))
        for entry in entries:
            if "id" in entry:  # a new call: its block, then its input's fragments
                out += self._close() + self._open({"type": "tool_use", "id": tool_use_id(entry["id"]),
                                                   "name": entry["function"]["name"], "input": {}})
            frag = entry["function"].get("arguments") or ""
            if frag and self.open == "tool_use":
                out.append(self.event("content_block_delta", index=self.blocks - 1,
                                      delta={"type": "input_json_delta", "partial_json": frag}))
        return out

    def finish(self, acc: Accumulated) -> list[dict[str, Any]]:
        """The closing events of a finished turn."""
        called = self.tools is not None and self.tools.called
        reason, seq = self.b.stop(acc, called)
        return self._close() + [
            self.event("message_delta", delta={"stop_reason": reason, "stop_sequence": seq},
                       usage={"input_tokens": acc.num_prompt_tokens, "output_tokens": acc.num_generated_tokens}),
            self.event("message_stop")]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.blocks += 1
        self.open = block["type"]
        return [self.event("content_block_start", index=self.blocks - 1, content_block=block)]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.blocks - 1)]


def sse(event: dict[str, Any]) -> bytes:
    """One event with its `event:` line, as Anthropic sends them."""
    return (f"event: {event['type']}\ndata: ".encode() + json.dumps(event, separators=(",", ":"),
                                                                     ensure_ascii=False).encode() + b"\n\n")
