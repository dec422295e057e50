"""Llama 3.1+ JSON calls: the template describes the tools and the model answers with a bare object,
`{"name": "get_weather", "parameters": {"city": "Paris"}}`, optionally after `<|python_tag|>`; several
calls are separated by "; ". A tool's result is rendered by the template (role `tool` / `ipython`).
"""

from __future__ import annotations

from .formats import Region, ToolFormat

PYTHON_TAG = "<|python_tag|>"


class Llama3Format(ToolFormat):
    name = "llama3_json"
    sep = "; "
    args_key = "parameters"

    @staticmethod
    def matches(template: str) -> bool:
        return "<|start_header_id|>" in template and ("tools" in template or "ipython" in template)

    def region(self, text: str) -> Region:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):  # the calls start after the tag
            at = len(text) - len(body)
            rest = body[len(PYTHON_TAG):]
            return Region(at, at + len(PYTHON_TAG) + len(rest) - len(rest.lstrip()))
        if body and PYTHON_TAG.startswith(body):  # maybe the tag, not yet whole
            return Region(0, None)
        return super().region(text)


LLAMA3 = Llama3Format()
