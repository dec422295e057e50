"""TEST-ONLY: log the token ids each request hands the engine, so a test can compare two transports' prompts.

Two front ends that claim to render "the same prompt" (gRPC and HTTP chat with tool calls, the Responses API and
chat completions) must give the engine the same token ids, not only the same count. No response carries a chat
prompt's ids, and none should just for a test; `install_prompt_log(engine)` (the test server's
`--test-log-prompts`, testing/serve.py) logs one line per request as the engine queues it, and `logged_prompts`
reads them back from the server's log.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

log = logging.getLogger("steadyserve.testing")

_LINE = re.compile(r"TEST-ONLY prompt of (\S+): (\[[0-9, ]*\])")


def install_prompt_log(engine: Any) -> None:
    """TEST-ONLY: wrap this LLMEngine's add_checked (every queued request passes there) with a log line."""
    log.warning("TEST-ONLY prompt log is ON: every request's prompt token ids are logged")
    queue = engine.add_checked

    def add_checked(request: Any) -> Any:
        log.warning("TEST-ONLY prompt of %s: %s", request.request_id, json.dumps(request.prompt_token_ids))
        return queue(request)

    engine.add_checked = add_checked


def logged_prompts(logs: str) -> dict[str, list[int]]:
    """request id -> prompt token ids, from a server log written with install_prompt_log."""
    return {m.group(1): json.loads(m.group(2)) for m in _LINE.finditer(logs)}
