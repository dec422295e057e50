"""Which tool format a model writes, decided once per tokenizer from its chat template."""

from __future__ import annotations

import json
from typing import Any

from .formats import ToolFormat
from .generic import GENERIC
from .hermes import HERMES
from .llama3 import LLAMA3

_FORMATS: dict[int, ToolFormat] = {}  # id(tokenizer) -> its format: templates do not change while serving


def format_for(tokenizer: Any) -> ToolFormat:
    """The tool format of this model's chat template: Hermes, Llama 3 JSON, else the generic one."""
    key = id(tokenizer)
    if key not in _FORMATS:
        template = getattr(tokenizer, "chat_template", None) or ""
        template = template if isinstance(template, str) else json.dumps(template)
        _FORMATS[key] = next((f for f in (HERMES, LLAMA3) if f.matches(template)), GENERIC)
    return _FORMATS[key]
