"""TEST-ONLY: log what the engine is handed (each request's prompt token ids, each abort), for tests to read back.

Two front ends that claim to render "the same prompt" (gRPC and HTTP chat with tool calls, the Responses API and
chat completions) must give the engine the same token ids, not only the same count. No response carries a chat
prompt's ids, and none should just for a test; `install_prompt_log(engine)` (the test server's
`--test-log-prompts`, testing/serve.py) logs one line per request as the engine queues it, and `logged_prompts`
reads them back from the server's log.

A stream that ends early must abort its engine request once, whatever the transport (engine/channel.py's
RequestChannel.cut is the one path); an abort of a request the engine no longer holds changes nothing the
server reports, so only the engine's own calls can count them: `install_abort_log(engine)` (`--test-log-aborts`)
logs one line per LLMEngine.abort_request call, and `logged_aborts` counts them per request id.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter
from typing import Any, Callable

log = logging.getLogger("steadyserve.testing")

_PROMPT = re.compile(r"TEST-ONLY prompt of (\S+): (\[[0-9, ]*\])")
_ABORT = re.compile(r"TEST-ONLY abort of (\S+)")


def _log_calls(engine: Any, method: str, line: Callable[[Any], str]) -> None:
    """Wrap the LLMEngine's `method` (one argument) with a warning line saying what it was handed."""
    call = getattr(engine, method)

    def logged(arg: Any) -> Any:
        log.warning("%s", line(arg))
        return call(arg)

    setattr(engine, method, logged)


def install_prompt_log(engine: Any) -> None:
    """TEST-ONLY: log every queued request's prompt ids (add_checked: every queued request passes there)."""
    log.warning("TEST-ONLY prompt log is ON: every request's prompt token ids are logged")
    _log_calls(engine, "add_checked",
               lambda r: f"TEST-ONLY prompt of {r.request_id}: {json.dumps(r.prompt_token_ids)}")


def install_abort_log(engine: Any) -> None:
    """TEST-ONLY: log every abort the engine thread takes (abort_request)."""
    log.warning("TEST-ONLY abort log is ON: every abort the engine receives is logged")
    _log_calls(engine, "abort_request", lambda request_id: f"TEST-ONLY abort of {request_id}")


def logged_prompts(logs: str) -> dict[str, list[int]]:
    """request id -> prompt token ids, from a server log written with install_prompt_log."""
    return {m.group(1): json.loads(m.group(2)) for m in _PROMPT.finditer(logs)}


def logged_aborts(logs: str) -> Counter[str]:
    """request id -> how many aborts the engine received for it, from a server log written with
    install_abort_log."""
    return Counter(m.group(1) for m in _ABORT.finditer(logs))
