"""How a steadyserve process ends once its command has returned: exit handlers, flushed stdio, then the exit
status, without the interpreter's teardown of every module and object.

Why: that teardown frees torch's, transformers' and the model's objects one by one; it takes about 1 s after
a server stops (0.5 s for the imports alone) and only delays the exit status a supervisor, a rolling restart
or a test waits for. Everything a command must finish is finished before it returns (the server's shutdown
stops gRPC, HTTP and the engine in order); what is left runs here as it would at a normal exit: threads that
are still working are waited for (then this falls back to the normal exit), atexit handlers run (logging's
flush of every handler is one), and stdout and stderr are flushed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """End the process with `code`; only for a process entry point (never inside a caller's process)."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)  # a thread is still working: the normal exit waits for it
    atexit._run_exitfuncs()  # the handlers a normal exit runs, in the same order
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it anyway
            pass
    os._exit(code)
