"""Start-up an operator can watch (progress.py) and a model file hashed once per version (file_digest.py)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time

from steadyserve.models import file_digest
from steadyserve.models.file_digest import file_sha256
from steadyserve.progress import Progress

MiB = 1024**2


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _progress_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "steadyserve.progress"]


def test_log_lines_carry_bytes_rate_and_eta_at_most_one_per_interval(caplog):
    caplog.set_level(logging.INFO, logger="steadyserve.progress")
    clock = _Clock()
    p = Progress("repacking weights", 100 * MiB, interval=2.0, bar=False, clock=clock)
    for _ in range(10):  # 10 MiB a second: a line every 2 s, not one per advance
        clock.now += 1.0
        p.advance(10 * MiB)
    p.close()
    recs = _progress_records(caplog)
    start, lines, end = recs[0], recs[1:-1], recs[-1]
    assert start.fields["total_bytes"] == 100 * MiB and "repacking weights: 100.0 MiB" in start.getMessage()
    assert len(lines) == 4, [r.getMessage() for r in lines]  # at 2, 4, 6, 8 s; the last advance ends the phase
    f = lines[1].fields  # at 4 s: 40 of 100 MiB at 10 MiB/s, 6 s left
    assert (f["done_bytes"], f["percent"], f["rate_mib_s"], f["eta_s"]) == (40 * MiB, 40.0, 10.0, 6.0)
    assert "40.0 MiB of 100.0 MiB (40%), 10.0 MiB/s, ETA 6 s" in lines[1].getMessage()
    assert end.fields["finished"] and "done, 100.0 MiB in 10.00 s" in end.getMessage()


def test_a_bar_redraws_in_place_and_the_phase_still_ends_in_the_log(caplog):
    caplog.set_level(logging.INFO, logger="steadyserve.progress")
    clock, out = _Clock(), io.StringIO()
    with Progress("hashing model.gguf", 4 * MiB, bar=True, stream=out, clock=clock) as p:
        for _ in range(4):
            clock.now += 0.5
            p.advance(MiB)
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n")
    assert "[###############...............] 2.0 MiB/4.0 MiB 2.0 MiB/s ETA 1s" in text
    assert [r.fields["done_bytes"] for r in _progress_records(caplog)] == [0, 4 * MiB]  # start and end only


def test_a_phase_left_by_an_exception_says_it_stopped(caplog):
    caplog.set_level(logging.INFO, logger="steadyserve.progress")
    try:
        with Progress("writing cache", MiB, bar=False) as p:
            p.advance(1000)
            raise OSError("disk full")
    except OSError:
        pass
    end = _progress_records(caplog)[-1]
    assert not end.fields["finished"] and "writing cache: stopped" in end.getMessage()


def _old(path, seconds_ago: float = 60.0) -> None:
    t = time.time() - seconds_ago
    os.utime(path, (t, t))


def test_a_files_digest_is_read_once_per_version(tmp_path, monkeypatch):
    f, cache = tmp_path / "m.gguf", tmp_path / "cache"
    f.write_bytes(b"weights v1" * 1000)
    _old(f)
    reads = []
    real = file_digest._read_digest
    monkeypatch.setattr(file_digest, "_read_digest", lambda *a: reads.append(a[0]) or real(*a))
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert file_sha256(f, cache) == want and file_sha256(f, cache) == want
    assert len(reads) == 1  # the second came from the kept entry
    f.write_bytes(b"weights v2" * 1000)  # same size, other bytes: mtime and ctime move
    _old(f, 30.0)
    assert file_sha256(f, cache) == hashlib.sha256(f.read_bytes()).hexdigest() and len(reads) == 2


def test_a_damaged_or_racy_digest_entry_is_recomputed_not_trusted(tmp_path):
    f, cache = tmp_path / "m.gguf", tmp_path / "cache"
    f.write_bytes(b"abc" * 100)
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert file_sha256(f, cache) == want
    assert not (cache / "digests").exists()  # modified just now: it may still change within the clock's tick
    _old(f)
    file_sha256(f, cache)
    (entry,) = (cache / "digests").iterdir()
    kept = json.loads(entry.read_text())
    for damage in ("{not json", json.dumps({**kept, "sha256": "0" * 64, "identity": "0:0:0:0:0"}),
                   json.dumps({**kept, "sha256": 12})):
        entry.write_text(damage)
        assert file_sha256(f, cache) == want
    entry.write_text(json.dumps({**kept, "sha256": "f" * 64}))  # a matching identity is believed, as git does
    assert file_sha256(f, cache) == "f" * 64


def test_a_quiet_phase_logs_only_its_end_and_nothing_when_it_fails(caplog):
    """A conversion can refuse its input: the refusal must stay the one line on stderr."""
    caplog.set_level(logging.INFO, logger="steadyserve.progress")
    try:
        with Progress("converting x.gguf", MiB, bar=False, quiet=True):
            raise ValueError("not a GGUF")
    except ValueError:
        pass
    assert not _progress_records(caplog)
    with Progress("converting x.gguf", MiB, bar=False, quiet=True) as p:
        p.advance(MiB)
    (end,) = _progress_records(caplog)
    assert "converting x.gguf: done, 1.0 MiB" in end.getMessage()


def test_the_logging_set_up_draws_bars_only_on_a_terminal_with_text_logs(monkeypatch):
    from steadyserve import logs, progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        for stream, fmt, bar in ((Tty(), "text", True), (Tty(), "json", False), (io.StringIO(), "text", False)):
            monkeypatch.setattr("sys.stderr", stream)
            logs.setup_logging(fmt)
            assert progress._bar is bar, (fmt, bar)
    finally:
        root.handlers[:], root.level = handlers, level
        progress.configure(False)


def test_a_long_phase_name_is_cut_so_the_bar_stays_one_line():
    out = io.StringIO()
    with Progress("hashing " + "x" * 200 + ".gguf", MiB, bar=True, stream=out, clock=_Clock()) as p:
        p.advance(MiB)
    line = out.getvalue().strip("\r\n")
    assert line.startswith("hashing xxx") and "..." in line and len(line) < 120, line
