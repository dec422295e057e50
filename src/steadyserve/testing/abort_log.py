"""TEST-ONLY: log every abort the engine receives, so a test can count how many times a request was aborted.

A client that goes away must abort its engine request once, whatever transport it used (engine/channel.py's
RequestChannel.cut is the one path). An abort of a request the engine no longer holds changes nothing the
server reports, so only a log of the engine's own calls can count them: `install_abort_log(engine)` (the test
server's `--test-log-aborts`, testing/serve.py) logs one line per LLMEngine.abort_request call, and
`logged_aborts` reads them back from the server's log.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Any

log = logging.getLogger("steadyserve.testing")

_LINE = re.compile(r"TEST-ONLY abort of (\S+)")


def install_abort_log(engine: Any) -> None:
    """TEST-ONLY: wrap this LLMEngine's abort_request (every abort the engine thread takes passes there)."""
    log.warning("TEST-ONLY abort log is ON: every abort the engine receives is logged")
    abort = engine.abort_request

    def abort_request(request_id: str) -> Any:
        log.warning("TEST-ONLY abort of %s", request_id)
        return abort(request_id)

    engine.abort_request = abort_request


def logged_aborts(logs: str) -> Counter[str]:
    """request id -> how many aborts the engine received for it, from a server log written with
    install_abort_log."""
    return Counter(m.group(1) for m in _LINE.finditer(logs))
