"""TEST-ONLY: engine faults on demand, to show a failing request fails alone and a dead engine is reported.

`install_test_faults(engine)` sets LLMEngine.fault_hook to react to marker strings in a request's prompt.
Production code never installs it: the test suite starts servers through steadyserve.testing.serve
(`--test-faults`), which passes it to the server as a start-up hook.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("steadyserve.testing")

FAIL_REQUEST_MARKER = "<<fail-request>>"  # that request fails alone, after its second generated token
KILL_ENGINE_MARKER = "<<kill-engine>>"  # the engine loop itself dies at that request's first step
SLOW_REQUEST_MARKER = "<<slow-request>>"  # each step that computes that request takes SLOW_STEP_S longer
SLOW_STEP_S = 0.005  # so N tokens take at least N x 5 ms on any CPU, however fast its steps are


class EngineKilledForTest(BaseException):
    """TEST-ONLY: a BaseException, so the per-request handler (which catches Exception) lets it kill the loop."""


def install_test_faults(engine: Any) -> None:
    """TEST-ONLY: install LLMEngine.fault_hook reacting to marker strings in a request's prompt."""
    log.warning("TEST-ONLY fault injection is ON: prompts containing %s fail, %s kills the engine, %s slow it",
                FAIL_REQUEST_MARKER, KILL_ENGINE_MARKER, SLOW_REQUEST_MARKER)
    tok = engine.tokenizer

    def hook(seq: Any) -> None:
        kind = getattr(seq, "_test_fault", None)
        if kind is None:
            text = tok.decode(seq.request.prompt_token_ids)
            kind = ("kill" if KILL_ENGINE_MARKER in text else "fail" if FAIL_REQUEST_MARKER in text
                    else "slow" if SLOW_REQUEST_MARKER in text else "")
            seq._test_fault = kind
        if kind == "kill":
            raise EngineKilledForTest("test fault: engine loop killed")
        if kind == "fail" and seq.num_generated_tokens >= 2:
            raise RuntimeError("test fault: request failed")
        if kind == "slow":
            time.sleep(SLOW_STEP_S)

    engine.fault_hook = hook
