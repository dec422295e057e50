"""The ready file (`--ready-file`): the bound ports of a serving process, for whoever started it.

`steadyserve serve` writes it once it serves; the test suite's ServerProcess and each Ray Serve replica's
child process poll it. Written atomically (a temporary file, then a rename), so a reader never sees half of
it; read as None until it is there and whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_ready_file(path: str | Path, http_port: int, grpc_port: int, pid: int) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps({"http_port": http_port, "grpc_port": grpc_port, "pid": pid}))
    os.replace(tmp, path)


def read_ready_file(path: str | Path) -> dict | None:
    """{"http_port", "grpc_port" (-1 when gRPC is off), "pid"}, or None while missing or being written."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
