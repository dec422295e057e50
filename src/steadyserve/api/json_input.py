"""JSON from clients, parsed within MAX_JSON_DEPTH: the HTTP body, the WebSocket request message, and gRPC's
JSON-valued fields (tools[].parameters_json) all pass here, so each refuses too deep a value alike.

json.loads itself recurses once per level and raises RecursionError near the interpreter's limit (about 1000
levels), which is not a ValueError: without this, a body of `[[[[...` a few KiB long was an unhandled error.
The depth is checked on the parsed value only when the text holds enough brackets to exceed it (str.count is
C-fast), so an ordinary request pays two scans of its text and nothing else.
"""

from __future__ import annotations

import json
from typing import Any

from ..limits import MAX_JSON_DEPTH, Refused


def too_deep(param: str | None, what: str) -> Refused:
    return Refused("json_too_deep", f"{what} nests objects and arrays more than {MAX_JSON_DEPTH} levels deep",
                   param)


def loads(text: str | bytes, what: str = "request body", param: str | None = None) -> Any:
    """`text` as JSON, refusing nesting past MAX_JSON_DEPTH with reason json_too_deep. Malformed JSON raises
    json.JSONDecodeError as json.loads does (each caller words that refusal its own way)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise too_deep(param, what) from None
    if _brackets(text) > MAX_JSON_DEPTH and depth(value) > MAX_JSON_DEPTH:
        raise too_deep(param, what)
    return value


def _brackets(text: str | bytes) -> int:
    if isinstance(text, bytes):
        return text.count(b"[") + text.count(b"{")
    return text.count("[") + text.count("{")


def depth(value: Any) -> int:
    """Levels of nested objects and arrays (a scalar is 0, `[]` is 1), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        deepest = max(deepest, d)
        if deepest > MAX_JSON_DEPTH:
            return deepest  # enough to refuse: the rest need not be walked
        stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list)))
    return deepest
