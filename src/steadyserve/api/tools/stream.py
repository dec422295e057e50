"""One choice's output as OpenAI's chat deltas when tools are on: text as `content`, calls as
`tool_calls` entries (first the id, type and name with empty arguments, then the arguments in fragments),
in the order OpenAI sends them.

The stream reads the output with the same format methods as the whole response (region, scan_calls), so
the text it sends is the response's content and each call's fragments concatenate to the response's
`arguments`. Content is sent with surrounding whitespace held back (the response strips it), and text that
may be the start of a call (Hermes' "<tool_" before "call>") waits until it is known.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from .formats import ParsedOutput, ToolFormat
from .scan import scan_calls


def call_id(request_id: str, choice: int, index: int) -> str:
    """A call's id: the same for the same request, choice and call, so a streamed and a whole response to
    one request id name their calls alike."""
    return "call_" + hashlib.sha256(f"{request_id}/{choice}/{index}".encode()).hexdigest()[:24]


def tool_calls_json(parsed: ParsedOutput, request_id: str, choice: int) -> list[dict[str, Any]]:
    """The message's `tool_calls`, OpenAI's shape."""
    return [{"id": call_id(request_id, choice, i), "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(parsed.calls)]


def tool_finish(reason: str | None, called: bool) -> str | None:
    """The finish reason of a turn with tools (OpenAI's, which every transport reports): a turn that stopped
    after making calls finished for `tool_calls`."""
    return "tool_calls" if called and reason == "stop" else reason


@dataclass(frozen=True)
class ToolTurn:
    """A finished choice's output with tools on, read back: what every transport's final answer carries."""

    content: str | None  # the text outside the calls, stripped; None when there is none
    tool_calls: list[dict[str, Any]]  # OpenAI's `tool_calls` (tool_calls_json)
    finish_reason: str | None  # tool_finish of the engine's finish reason


def tool_turn(fmt: ToolFormat, text: str, request_id: str, choice: int, reason: str | None) -> ToolTurn:
    """The one reading of a finished turn with tools: content, calls and finish reason."""
    parsed = fmt.parse(text)
    return ToolTurn(parsed.content, tool_calls_json(parsed, request_id, choice),
                    tool_finish(reason, bool(parsed.calls)))


@dataclass
class ToolCallStream:
    """The deltas of one choice, fed its text as it grows."""

    fmt: ToolFormat  # the model's tool format
    request_id: str  # for the calls' ids
    choice: int  # the choice's index, for the calls' ids
    text: str = ""  # the output so far
    content_sent: int = 0  # characters of the stripped content sent
    headers_sent: int = 0  # calls whose id and name were sent
    args_sent: list[int] = field(default_factory=list)  # per call: characters of its arguments sent

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool_calls delta entries) after `delta`; `finished` sends what was held back."""
        self.text += delta
        region = self.fmt.region(self.text)
        end = region.calls_start if region.calls_start is not None else \
            (len(self.text) if finished else region.content_end)
        content = self.text[:end].strip() if finished or region.calls_start is not None else \
            self.text[:end].lstrip().rstrip()
        out = content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(content))
        entries: list[dict[str, Any]] = []
        if region.calls_start is None:
            return out, entries
        calls_text = self.text[region.calls_start:]
        named = [c for c in scan_calls(calls_text, self.fmt.call_depth, self.fmt.args_key) if c.name is not None]
        for i, c in enumerate(named):
            if i >= self.headers_sent:
                entries.append({"index": i, "id": call_id(self.request_id, self.choice, i), "type": "function",
                                "function": {"name": c.name, "arguments": ""}})
                self.headers_sent += 1
                self.args_sent.append(0)
            args = c.arguments(calls_text)
            if len(args) > self.args_sent[i]:
                entries.append({"index": i, "function": {"arguments": args[self.args_sent[i]:]}})
                self.args_sent[i] = len(args)
        return out, entries

    @property
    def called(self) -> bool:
        """Whether any call was sent (the finish reason is then tool_calls)."""
        return self.headers_sent > 0
