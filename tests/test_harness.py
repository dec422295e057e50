"""The test harness itself: skips are not silent, server pairs start all-or-nothing, nothing is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from steadyserve.testing.server import ServerProcess, start_servers

TESTS = Path(__file__).resolve().parent

SKIPPING = '''
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_skips():
    pytest.skip("no widget on this machine")
'''


IMPORT_SKIPPING = '''
import pytest

pytest.importorskip("no_such_module_anywhere")


def test_never_collected():
    assert False
'''


def run_pytest(tmp_path: Path, source: str | None = SKIPPING, **env: str) -> subprocess.CompletedProcess:
    """A pytest session over one file that skips, with this suite's conftest hooks loaded as a plugin.
    `source` None: the file is already written (sessions run side by side over it)."""
    if source is not None:
        (tmp_path / "test_sample.py").write_text(source)
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "STEADYSERVE_STRICT_SKIPS")}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:randomly",
                           "-p", "no:cacheprovider", str(tmp_path / "test_sample.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**clean, "PYTHONPATH": str(TESTS), **env})


def test_a_skip_is_an_error_in_ci_and_always_reported(tmp_path: Path):
    (tmp_path / "test_sample.py").write_text(SKIPPING)
    envs = ({}, {"CI": "true"}, {"STEADYSERVE_STRICT_SKIPS": "1"})
    with ThreadPoolExecutor(len(envs)) as pool:  # three independent sessions: side by side
        relaxed, *stricts = pool.map(lambda env: run_pytest(tmp_path, None, **env), envs)
    assert relaxed.returncode == 0, relaxed.stdout
    assert "1 passed, 1 skipped" in relaxed.stdout
    assert "1 test(s) skipped" in relaxed.stdout and "no widget on this machine [NOT allow-listed]" in relaxed.stdout
    for strict in stricts:
        assert strict.returncode == 1, strict.stdout
        assert "1 failed, 1 passed" in strict.stdout and "SKIP IS AN ERROR" in strict.stdout, strict.stdout
        assert "no widget on this machine" in strict.stdout


def test_a_module_skipped_while_collecting_is_reported_and_an_error_in_ci(tmp_path: Path):
    """A module-level importorskip skips before any test report exists; the hook on collection sees it."""
    relaxed = run_pytest(tmp_path, IMPORT_SKIPPING)
    assert relaxed.returncode == 5 and "1 skipped" in relaxed.stdout, relaxed.stdout  # 5: no test ran
    assert "1 test(s) skipped" in relaxed.stdout and "no_such_module_anywhere" in relaxed.stdout
    strict = run_pytest(tmp_path, IMPORT_SKIPPING, CI="true")
    assert strict.returncode == 2, strict.stdout  # 2: a collection error
    assert "SKIP IS AN ERROR" in strict.stdout and "skipped while collecting" in strict.stdout, strict.stdout


def _steadyserve_pids(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def _test_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("steadyserve-test-*")}


def test_server_pair_is_all_or_nothing_and_leaves_nothing(tiny_model: str, tmp_path: Path, monkeypatch):
    # The servers' temporary directories go to a folder of this test's own, so another steadyserve test run
    # on the same machine (creating and removing its own in the shared /tmp) cannot change what is compared:
    # it failed that way twice while two suites ran side by side.
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))
    marker = f"pair-{os.getpid()}-{tmp_path.name}"
    dirs0 = _test_dirs()
    assert dirs0 == set()
    with pytest.raises(RuntimeError, match="server exited"):
        start_servers(((tiny_model, "--served-model-name", marker), {"threads": 1}),
                      ((str(tmp_path / "no-such-model"), "--served-model-name", marker), {"threads": 1}))
    # The server that did start was stopped: no process with the marker, no temporary directory left.
    assert _steadyserve_pids(marker) == []
    assert _test_dirs() == dirs0
    with ServerProcess(tiny_model, "--served-model-name", marker, threads=1) as s:
        assert _steadyserve_pids(marker) == [s.proc.pid]
        assert Path(s.log_path).exists()
    assert _steadyserve_pids(marker) == [] and _test_dirs() == dirs0
    assert "model fingerprint" in s.logs()  # what the log held stays readable after clean-up
    assert Path(s.log_path).parent.parent == own_tmp  # the directories compared were the servers' own
