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


def run_pytest(tmp_path: Path, source: str | None = SKIPPING, workers: int = 0, **env: str) -> subprocess.CompletedProcess:
    """A pytest session over one file that skips, with this suite's conftest hooks loaded as a plugin.
    `source` None: the file is already written (sessions run side by side over it). workers: pytest-xdist
    processes, as `make test` runs (0: none, the hooks run in the one process)."""
    if source is not None:
        (tmp_path / "test_sample.py").write_text(source)
    # This suite's own xdist worker variables (PYTEST_XDIST_*) would make the inner session think it is a worker.
    clean = {k: v for k, v in os.environ.items()
             if k not in ("CI", "STEADYSERVE_STRICT_SKIPS") and not k.startswith("PYTEST_XDIST")}
    # Without the plugins the sample never uses (schemathesis, hypothesis, anyio): importing them was most of each
    # inner session's time (2.3 -> 0.3 s in one process; an xdist session imports them three times).
    unused = [arg for name in ("schemathesis", "hypothesispytest", "anyio") for arg in ("-p", f"no:{name}")]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:randomly",
                           "-p", "no:cacheprovider", *unused, "-n", str(workers), str(tmp_path / "test_sample.py")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**clean, "PYTHONPATH": str(TESTS), **env})


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist"])
def test_a_skip_is_an_error_in_ci_and_always_reported(tmp_path: Path, workers: int):
    """In one process and across pytest-xdist workers (as `make test` runs): a skip in a worker is listed by the
    process that prints the summary, and fails a strict run."""
    (tmp_path / "test_sample.py").write_text(SKIPPING)
    envs = ({}, {"CI": "true"}, {"STEADYSERVE_STRICT_SKIPS": "1"})
    with ThreadPoolExecutor(len(envs)) as pool:  # three independent sessions: side by side
        relaxed, *stricts = pool.map(lambda env: run_pytest(tmp_path, None, workers, **env), envs)
    assert relaxed.returncode == 0, relaxed.stdout
    assert "1 passed, 1 skipped" in relaxed.stdout
    assert "1 test(s) skipped" in relaxed.stdout and "no widget on this machine [NOT allow-listed]" in relaxed.stdout
    for strict in stricts:
        assert strict.returncode == 1, strict.stdout
        assert "1 failed, 1 passed" in strict.stdout and "SKIP IS AN ERROR" in strict.stdout, strict.stdout
        assert "no widget on this machine" in strict.stdout


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist"])
def test_a_module_skipped_while_collecting_is_reported_and_an_error_in_ci(tmp_path: Path, workers: int):
    """A module-level importorskip skips before any test report exists; the hook on collection sees it."""
    relaxed = run_pytest(tmp_path, IMPORT_SKIPPING, workers)
    assert relaxed.returncode == 5 and "1 skipped" in relaxed.stdout, relaxed.stdout  # 5: no test ran
    assert "1 test(s) skipped" in relaxed.stdout and "no_such_module_anywhere" in relaxed.stdout
    strict = run_pytest(tmp_path, IMPORT_SKIPPING, workers, CI="true")
    # 2: a collection error; pytest-xdist ends a run whose worker could not collect with 1 (a failed run)
    assert strict.returncode == (1 if workers else 2), strict.stdout
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
