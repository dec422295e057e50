"""Logging set-up: human-readable lines by default, JSON lines with --log-format json.

Structured fields travel in `extra={"fields": {...}}`; both formats print them.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        fields = getattr(record, "fields", None)
        extra = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None) if fields else ""
        line = f"{ts} {record.levelname:<7} {record.name}: {record.getMessage()}" + (f" {extra}" if extra else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage(), **(getattr(record, "fields", None) or {})}
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


class StderrHandler(logging.StreamHandler):
    """Writes each record to the sys.stderr of the moment, not the one at set-up: a process that swaps
    stderr (a test's capture, then its close) must not leave threads logging into a closed file."""

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 (a text stream)
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:  # StreamHandler.__init__ assigns it
        pass


def setup_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """Also picks how start-up progress renders (progress.py): a bar on a terminal with text logs, else log lines."""
    from .progress import configure, wants_bar

    configure(wants_bar(fmt))
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("uvicorn.access", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
