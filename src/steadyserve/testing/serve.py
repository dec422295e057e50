"""TEST-ONLY entry point: `steadyserve serve` with the test suite's start-up hooks.

    python -m steadyserve.testing.serve [--test-faults] [--test-drift] [--test-memory-root DIR] [--test-log-prompts]
        [--test-log-aborts] SERVE-FLAGS...

--test-faults: engine faults on marker prompts (testing/faults.py). --test-drift: batch drift installed after
the self-test, so the server claims invariance it lacks (testing/drift.py). --test-memory-root DIR: the memory
limit is read from DIR/proc/self/cgroup, DIR/sys/fs/cgroup/..., DIR/proc/meminfo (a fixture tree) instead of
the machine's (steadyserve.memory.set_test_root). --test-log-prompts: each request's prompt token ids are
logged (testing/prompt_log.py). --test-log-aborts: each abort the engine receives is logged
(testing/prompt_log.py). The production server reads no switch for any of them; only
this module, which tests start, installs them.
"""

from __future__ import annotations

import logging
import sys

from ..api.startup import EngineHooks
from ..cli import build_parser, cmd_serve
from ..memory import set_test_root
from .drift import install_batch_drift
from .faults import install_test_faults
from .prompt_log import install_abort_log, install_prompt_log

log = logging.getLogger("steadyserve.testing")


def main(argv: list[str]) -> int:
    hooks = EngineHooks()
    if "--test-faults" in argv:
        argv = [a for a in argv if a != "--test-faults"]
        hooks.after_engine.append(install_test_faults)
    if "--test-log-prompts" in argv:
        argv = [a for a in argv if a != "--test-log-prompts"]
        hooks.after_engine.append(install_prompt_log)
    if "--test-log-aborts" in argv:
        argv = [a for a in argv if a != "--test-log-aborts"]
        hooks.after_engine.append(install_abort_log)
    if "--test-drift" in argv:
        argv = [a for a in argv if a != "--test-drift"]

        def drift(engine) -> None:
            log.warning("TEST-ONLY batch drift is ON: logprobs depend on the step's token count, while the "
                        "fingerprint still says -bi")
            install_batch_drift(engine)

        hooks.after_selftest.append(drift)
    if "--test-memory-root" in argv:
        i = argv.index("--test-memory-root")
        root, argv = argv[i + 1], argv[:i] + argv[i + 2:]
        log.warning("TEST-ONLY memory limit read under %s", root)
        set_test_root(root)
    return cmd_serve(build_parser().parse_args(["serve", *argv]), hooks)


if __name__ == "__main__":
    from ..process_exit import exit_process

    exit_process(main(sys.argv[1:]))
