"""The Responses API's output: the response object, and the server-sent events of a streamed one.

Both read the choice's output through the tool format's parser and ToolCallStream (api/tools), as chat
completions do, so a streamed response's text deltas concatenate to its message's text and each call's
argument deltas to its `arguments`. A stream's events, in the order OpenAI documents them:

    response.created, response.in_progress,
    per message:  response.output_item.added, response.content_part.added, response.output_text.delta...,
                  response.output_text.done, response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta...,
                  response.function_call_arguments.done, response.output_item.done
    response.completed (response.incomplete when max_output_tokens cut it)

An error after the stream started ends it with one `error` event.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..events import Accumulated
from ..tools import ParsedOutput, ToolCallStream, ToolFormat, call_id
from .responses import ResponsesRequest


class ResponseBuilder:
    """One response's identity and echoed settings; builds its object and items."""

    def __init__(self, response_id: str, request_id: str, model: str, fingerprint: str, req: ResponsesRequest,
                 tool_format: ToolFormat | None) -> None:
        self.id = response_id  # resp_...: the store's key
        self.request_id = request_id  # the calls' ids derive from it (as chat's)
        self.model = model
        self.fingerprint = fingerprint
        self.req = req
        self.tool_format = tool_format  # None: no tools offered, the output is text
        self.created = int(time.time())

    def message_id(self) -> str:
        return "msg_" + self.id[len("resp_"):]

    def call_item_id(self, i: int) -> str:
        return f"fc_{self.id[len('resp_'):]}_{i}"

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id(), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def call_item(self, i: int, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": self.call_item_id(i), "call_id": call_id(self.request_id, 0, i),
                "name": name, "arguments": arguments, "status": status}

    def parse(self, text: str) -> ParsedOutput:
        return self.tool_format.parse(text) if self.tool_format is not None else ParsedOutput(text, [])

    def output(self, acc: Accumulated) -> list[dict[str, Any]]:
        parsed = self.parse(acc.text)
        status = "completed" if acc.finish_reason == "stop" else "incomplete"
        items = [self.message_item(parsed.content or "", status)] if parsed.content or not parsed.calls else []
        return items + [self.call_item(i, n, a, status) for i, (n, a) in enumerate(parsed.calls)]

    def body(self, status: str, output: list[dict[str, Any]], acc: Accumulated | None = None) -> dict[str, Any]:
        """The response object; `acc` (the finished choice) gives usage and why it is incomplete."""
        r = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = None if acc is None else {
            "input_tokens": acc.num_prompt_tokens, "input_tokens_details": {"cached_tokens": acc.num_cached_tokens},
            "output_tokens": acc.num_generated_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": acc.num_prompt_tokens + acc.num_generated_tokens}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
                "incomplete_details": incomplete, "instructions": r.instructions,
                "max_output_tokens": r.max_output_tokens, "model": self.model, "output": output,
                "parallel_tool_calls": r.parallel_tool_calls is not False,
                "previous_response_id": r.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": r.store, "temperature": r.temperature, "top_p": r.top_p,
                "text": r.text or {"format": {"type": "text"}}, "tool_choice": r.tool_choice or
                ("auto" if r.tools else "none"), "tools": r.tools or [], "truncation": "disabled",
                "metadata": r.metadata or {}, "usage": usage, "system_fingerprint": self.fingerprint}

    def final(self, acc: Accumulated) -> dict[str, Any]:
        return self.body("completed" if acc.finish_reason == "stop" else "incomplete", self.output(acc), acc)


def conversation_output(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a later previous_response_id continues from."""
    text = "".join(p["text"] for item in body["output"] if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                     "arguments": item["arguments"]}}
             for item in body["output"] if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return [message]


class EventWriter:
    """The stream's events for one choice, fed its text as it grows (ToolCallStream splits text and calls)."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.b = builder
        self.seq = 0
        fmt = builder.tool_format
        self.tools = ToolCallStream(fmt, builder.request_id, 0) if fmt is not None else None
        self.text = ""  # the message's text so far
        self.items: list[dict[str, Any]] = []  # output items opened so far, in order
        self.message_open = False
        self.open_call: int | None = None  # index in `items` of the call being streamed
        self.calls = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict[str, Any]]:
        body = self.b.body("in_progress", [])
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def feed(self, delta: str, finished: bool) -> list[dict[str, Any]]:
        if self.tools is None:
            content, entries = (delta, [])
        else:
            content, entries = self.tools.feed(delta, finished)
        out: list[dict[str, Any]] = []
        if content:
            if not self.message_open:
                out += self._close_call() + self._open_message()
            self.text += content
            out.append(self.event("response.output_text.delta", item_id=self.b.message_id(),
                                  output_index=self._message_index(), content_index=0, delta=content, logprobs=[]))
        for entry in entries:
            if "id" in entry:  # a new call: its item, then its arguments
                out += self._close_message() + self._close_call()
                self.items.append(self.b.call_item(self.calls, entry["function"]["name"], "", "in_progress"))
                self.open_call, self.calls = len(self.items) - 1, self.calls + 1
                out.append(self.event("response.output_item.added", output_index=self.open_call,
                                      item=self.items[self.open_call]))
            frag = entry["function"].get("arguments") or ""
            if frag and self.open_call is not None:
                item = self.items[self.open_call]
                item["arguments"] += frag
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.open_call, delta=frag))
        return out

    def finish(self, acc: Accumulated) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The closing events and the final response object (what the store keeps)."""
        status = "completed" if acc.finish_reason == "stop" else "incomplete"
        out = self._open_message() if not self.items else []  # an empty answer is still a message
        out += self._close_message(status) + self._close_call(status)
        body = self.b.body(status, self.items, acc)
        out.append(self.event("response.completed" if status == "completed" else "response.incomplete",
                              response=body))
        return out, body

    def _open_message(self) -> list[dict[str, Any]]:
        self.items.append(self.b.message_item("", "in_progress"))
        self.message_open = True
        idx = len(self.items) - 1
        item = {**self.items[idx], "content": []}
        return [self.event("response.output_item.added", output_index=idx, item=item),
                self.event("response.content_part.added", item_id=self.b.message_id(), output_index=idx,
                           content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def _message_index(self) -> int:
        return next(i for i, it in enumerate(self.items) if it["type"] == "message")

    def _close_message(self, status: str = "completed") -> list[dict[str, Any]]:
        if not self.message_open:
            return []
        self.message_open = False
        idx = self._message_index()
        self.items[idx] = self.b.message_item(self.text, status)
        part = self.items[idx]["content"][0]
        mid = self.b.message_id()
        return [self.event("response.output_text.done", item_id=mid, output_index=idx, content_index=0,
                           text=self.text, logprobs=[]),
                self.event("response.content_part.done", item_id=mid, output_index=idx, content_index=0, part=part),
                self.event("response.output_item.done", output_index=idx, item=self.items[idx])]

    def _close_call(self, status: str = "completed") -> list[dict[str, Any]]:
        if self.open_call is None:
            return []
        idx, self.open_call = self.open_call, None
        item = self.items[idx]
        item["status"] = status
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=idx, item=item)]


def sse(event: dict[str, Any]) -> bytes:
    """One event with its `event:` line, as OpenAI sends them."""
    return (f"event: {event['type']}\ndata: ".encode() + json.dumps(event, separators=(",", ":"),
                                                                     ensure_ascii=False).encode() + b"\n\n")
