"""Logging set-up (steadyserve/logs.py): records go to the stderr of the moment.

A process that swaps sys.stderr (pytest's capture of an in-process CLI call, then its close) once left the
engine thread of a later test logging into the closed file ("--- Logging error --- I/O operation on closed
file" in the suite's output)."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from steadyserve.logs import setup_logging


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_records_follow_sys_stderr_after_it_is_swapped(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        setup_logging(fmt)
        first.close()  # what a capture does when its test ends
        later = io.StringIO()
        monkeypatch.setattr(sys, "stderr", later)
        logging.getLogger("steadyserve.test").info("engine loop started", extra={"fields": {"thread": "t"}})
        out = later.getvalue()
        assert "Logging error" not in out, out  # logging's own report of a failed write goes to stderr too
        (line,) = out.strip().splitlines()
        assert "engine loop started" in line
        if fmt == "json":
            assert json.loads(line)["thread"] == "t"
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
