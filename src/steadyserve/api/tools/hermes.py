"""Hermes / Qwen 2.5+ calls: JSON objects in `<tool_call>` blocks, which the chat template renders itself.

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text may come before the first block (it is the message's content); under tool_choice auto the grammar
lets a text answer start with anything but '<', and blocks found after text are parsed all the same.
"""

from __future__ import annotations

from .formats import Region, ToolFormat

TAG = "<tool_call>"


class HermesFormat(ToolFormat):
    name = "hermes"
    open = TAG + "\n"
    close = "\n</tool_call>"
    sep = "\n"
    first_char = "<"

    @staticmethod
    def matches(template: str) -> bool:
        return TAG in template

    def region(self, text: str) -> Region:
        at = text.find(TAG)
        if at >= 0:
            return Region(at, at)
        # Hold back a tail that may be the start of a tag ("<tool_" of "<tool_call>").
        for k in range(min(len(TAG) - 1, len(text)), 0, -1):
            if TAG.startswith(text[-k:]):
                return Region(len(text) - k, None)
        return Region(len(text), None)


HERMES = HermesFormat()
