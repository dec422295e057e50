"""Finding function calls in a model's (possibly unfinished) output text, one scanner for every format.

A call is a JSON object with a name and an arguments object (`arguments`, or Llama 3's `parameters`) at a
known depth: 1 for Hermes' `<tool_call>` blocks and Llama 3's bare objects, 3 for the generic format's
`{"tool_calls": [{...}, ...]}`. The scanner reads the text as it is so far: a call's arguments are the raw
characters of its arguments value, so while a stream is running they only ever grow, and the fragments a
stream sends concatenate exactly to the arguments of the whole response (no re-serialization, which would
change spacing or escapes). Characters outside JSON (tags, separators) are skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class ScannedCall:
    """One call object found so far."""

    name: str | None = None  # the complete name string; None until its closing quote has been read
    args_start: int | None = None  # offset of the arguments value's first character ('{')
    args_end: int | None = None  # offset just past its closing '}'; None while it is still open
    closed: bool = False  # the call object's own '}' has been read

    def arguments(self, text: str) -> str:
        """The raw arguments text so far ("" before it starts)."""
        if self.args_start is None:
            return ""
        return text[self.args_start:self.args_end if self.args_end is not None else len(text)]


def scan_calls(text: str, call_depth: int, args_key: str) -> list[ScannedCall]:
    """The call objects at `call_depth` in `text`, in order, as far as the text goes."""
    calls: list[ScannedCall] = []
    stack: list[str] = []  # open containers, '{' or '['
    cur: ScannedCall | None = None  # the call object being read
    key: str | None = None  # the key whose value is being read, at call depth
    expect_key = False  # the next string at call depth is a key
    in_str, esc, str_start = False, False, 0
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if cur is not None and len(stack) == call_depth:
                    try:
                        s = json.loads(text[str_start:i + 1])
                    except json.JSONDecodeError:
                        s = None
                    if expect_key:
                        key, expect_key = s, False
                    elif key == "name" and cur.name is None and isinstance(s, str):
                        cur.name = s
            continue
        if ch == '"':
            in_str, str_start = True, i
        elif ch in "{[":
            if cur is not None and len(stack) == call_depth and key == args_key and cur.args_start is None:
                cur.args_start = i
            stack.append(ch)
            if ch == "{" and len(stack) == call_depth:
                cur, key, expect_key = ScannedCall(), None, True
                calls.append(cur)
        elif ch in "}]":
            if ch == "}" and cur is not None and len(stack) == call_depth:
                cur.closed, cur = True, None
            if stack:
                stack.pop()
            if cur is not None and len(stack) == call_depth and key == args_key and cur.args_end is None \
                    and cur.args_start is not None:
                cur.args_end = i + 1
        elif ch == "," and cur is not None and len(stack) == call_depth:
            key, expect_key = None, True
    return calls
