"""Progress of the long start-up phases (hashing the model file, repacking its weights, reading or writing the
packed-weight cache), in bytes with a rate and an ETA, so an operator can watch a multi-GB model load.

Two renderings: on a terminal with text logs, one bar redrawn in place on stderr; anywhere else (a container's
log, a pipe, --log-format json) INFO log lines on the `steadyserve.progress` logger, at most one per
`interval` seconds, each with the same structured fields (phase, done_bytes, total_bytes, percent,
rate_mib_s, eta_s) in both log formats. Every phase ends with one log line, whichever rendering it had, so
the log always holds how long each phase took. The command line chooses the rendering (`configure`) once its
logging is set up; a library caller gets log lines.

Pure Python: the loader imports it before torch matters, and its tests need no model.
"""

from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Callable, TextIO

log = logging.getLogger("steadyserve.progress")

MiB = 1024**2
_BAR_WIDTH = 30
_NAME_WIDTH = 40  # a bar's phase name at most: the bar must fit one terminal line to be redrawn in place
_bar = False  # draw bars on stderr (set by configure); log lines otherwise


def configure(bar: bool) -> None:
    """Bars (True: stderr is a terminal and the logs are text) or log lines (False) from now on."""
    global _bar
    _bar = bar


def wants_bar(log_format: str) -> bool:
    """Whether a process logging in `log_format` to this stderr should draw bars: a terminal and text logs."""
    try:
        return log_format == "text" and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stderr
        return False


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"


class Progress:
    """One phase of `total` bytes. `advance(n)` as bytes are done; `close()` (or leaving the `with`) ends it.
    `quiet`: no line when the phase starts or fails, only its progress and its end (a step that may refuse the
    input, whose refusal must stay the one line on stderr). `clock` and `stream` are for tests; `bar`
    overrides the process's rendering."""

    def __init__(self, phase: str, total: int, *, interval: float = 2.0, bar: bool | None = None, quiet: bool = False,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.phase = phase  # what is being done, e.g. "repacking weights"
        self.total = max(int(total), 0)  # bytes the phase will cover
        self.done = 0  # bytes covered so far
        self.interval = interval  # seconds between log lines (and between bar redraws at most 10x as often)
        self.bar = _bar if bar is None else bar
        self.stream = stream
        self.clock = clock
        self.start = clock()
        self._last = self.start  # when the last line or bar was shown
        self._closed = False
        self.quiet = quiet
        if not quiet:
            log.info(f"{phase}: {_mib(self.total)}", extra={"fields": {"phase": phase, "total_bytes": self.total,
                                                                        "done_bytes": 0}})

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(failed=kind is not None)

    def fields(self) -> dict[str, float | int | str]:
        """The structured fields of a line now: rate over the whole phase so far, ETA at that rate."""
        elapsed = max(self.clock() - self.start, 1e-9)
        rate = self.done / elapsed
        left = max(self.total - self.done, 0)
        return {"phase": self.phase, "done_bytes": self.done, "total_bytes": self.total,
                "percent": round(100.0 * self.done / self.total, 1) if self.total else 100.0,
                "rate_mib_s": round(rate / MiB, 1), "eta_s": round(left / rate, 1) if rate > 0 else None,
                "elapsed_s": round(elapsed, 2)}

    def advance(self, n: int) -> None:
        self.done += int(n)
        now = self.clock()
        if self.bar:
            if now - self._last >= self.interval / 10 or self.done >= self.total:
                self._last = now
                self._draw()
        elif now - self._last >= self.interval and self.done < self.total:
            self._last = now
            f = self.fields()
            eta = f"ETA {f['eta_s']:.0f} s" if f["eta_s"] is not None else "ETA ?"
            log.info(f"{self.phase}: {_mib(self.done)} of {_mib(self.total)} ({f['percent']:.0f}%), "
                     f"{f['rate_mib_s']} MiB/s, {eta}", extra={"fields": f})

    def _draw(self) -> None:
        f = self.fields()
        filled = int(_BAR_WIDTH * self.done / self.total) if self.total else _BAR_WIDTH
        eta = f"ETA {f['eta_s']:.0f}s" if f["eta_s"] is not None else "ETA ?"
        stream = self.stream or sys.stderr
        name = self.phase if len(self.phase) <= _NAME_WIDTH else self.phase[:_NAME_WIDTH - 3] + "..."  # one line
        stream.write(f"\r{name} [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {_mib(self.done)}/"
                     f"{_mib(self.total)} {f['rate_mib_s']} MiB/s {eta}  ")
        stream.flush()

    def close(self, failed: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if failed and self.quiet:
            return
        if self.bar:
            stream = self.stream or sys.stderr
            stream.write("\n")
            stream.flush()
        f = self.fields()
        f.pop("eta_s")
        word = "stopped" if failed else "done"
        log.info(f"{self.phase}: {word}, {_mib(self.done)} in {f['elapsed_s']:.2f} s ({f['rate_mib_s']} MiB/s)",
                 extra={"fields": {**f, "finished": not failed}})
