"""The native kernels' build cache: a killed build never blocks the next one, and a finished one loads as is.

`python -m steadyserve.kernels` is what `make install` runs. torch's cpp_extension marks a build in progress
with a lock file; a build killed half-way (a CI timeout, SIGKILL) used to leave it, and the next `make test`
on that machine then waited on it until CI's 90 minutes ran out."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from steadyserve.kernels import build


def _copy_of_the_built_cache(tmp_path: Path) -> Path:
    """The real, finished build directory copied (mtimes kept) under a temporary STEADYSERVE_CACHE."""
    status = build.load()
    assert status.available, status.detail
    src = build._cache_dir()
    dst = tmp_path / "kernels" / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("build.flock"))
    return dst


def _build_in(cache_root: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, STEADYSERVE_CACHE=str(cache_root))
    return subprocess.run([sys.executable, "-m", "steadyserve.kernels"], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _ninja_finds_it_current(build_dir: Path) -> bool:
    """Whether ninja would compile nothing in `build_dir` (a dry run). Not so when the cache was kept from an
    earlier checkout of the same sources (a CI machine's ~/.cache): the sources are then newer than the
    objects and ninja recompiles everything, which takes minutes."""
    import ninja

    dry = subprocess.run([os.path.join(ninja.BIN_DIR, "ninja"), "-C", str(build_dir), "-n"], capture_output=True,
                         text=True, timeout=60)
    return dry.returncode == 0 and "no work to do" in dry.stdout


def test_a_killed_builds_lock_file_does_not_block_the_next_build(tmp_path: Path) -> None:
    """torch waits while its lock file exists; a killed build's stale one must be removed at once, and the build
    go on. Where ninja finds the objects current, it also finishes (seconds) and marks the directory built."""
    built = _copy_of_the_built_cache(tmp_path)
    (built / build.BUILT_MARK).unlink()  # as a build killed before it finished leaves the directory
    stale = built / build.TORCH_BATON
    stale.touch()
    os.utime(stale, (1_000_000_000, 1_000_000_000))  # told apart from the lock torch itself makes when it builds
    current = _ninja_finds_it_current(built)
    env = dict(os.environ, STEADYSERVE_CACHE=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "steadyserve.kernels"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while _is_the_stale_lock(stale) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _is_the_stale_lock(stale), "the build still waits on the killed build's lock file after 60 s"
        if not current:
            return  # the build went on; it would now compile for minutes
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
        assert "native kernels nat1" in out
        assert not stale.exists()
        assert (built / build.BUILT_MARK).exists()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _is_the_stale_lock(path: Path) -> bool:
    try:
        return path.stat().st_mtime == 1_000_000_000
    except FileNotFoundError:
        return False


def test_a_finished_build_loads_without_ninja_or_a_write(tmp_path: Path) -> None:
    built = _copy_of_the_built_cache(tmp_path)
    for name in os.listdir(built):  # keep only the library and its mark: nothing a build could reuse
        if (built / name).is_dir():
            shutil.rmtree(built / name)  # the test-only ops' library (build.load_test_ops)
        elif name not in (build.LIBRARY, build.BUILT_MARK):
            os.remove(built / name)
    before = sorted(os.listdir(built))
    done = _build_in(tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(os.listdir(built)) == before  # no build file, no lock, no object was written


def test_each_checkout_builds_in_its_own_directory(tmp_path: Path, monkeypatch) -> None:
    """ninja's build file names absolute source paths: two checkouts sharing a directory rebuild each other."""
    here = build._cache_dir()
    other = tmp_path / "csrc"
    shutil.copytree(build.CSRC, other)
    monkeypatch.setattr(build, "CSRC", other)
    monkeypatch.setattr(build, "SOURCES", [other / s.name for s in build.SOURCES])
    monkeypatch.setattr(build, "HEADERS", [other / h.name for h in build.HEADERS])
    assert build._cache_dir() != here


def test_another_compiler_is_another_build(monkeypatch) -> None:
    """The compiler (and its version) keys the cache: objects from one are never loaded as another's."""
    here = build._cache_dir()
    monkeypatch.setenv("CXX", "clang++-not-installed")
    assert build._cache_dir() != here
    monkeypatch.setenv("CXX", "c++")
    assert build._cache_dir() == here


def test_the_production_library_registers_no_test_only_op() -> None:
    """Test-only ops live in their own library (csrc/testing, build.load_test_ops): a server process has none."""
    code = ("import torch; from steadyserve.kernels import load; assert load().available\n"
            "ops = torch.ops.steadyserve\n"
            "print(hasattr(ops, 'qmatmul_'), hasattr(ops, 'q8quantize'), hasattr(ops, 'qlog_softmax'))\n"
            "from steadyserve.kernels.build import load_test_ops; load_test_ops()\n"
            "print(hasattr(ops, 'q8quantize'), hasattr(ops, 'kv_floats_to_halves'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.stdout.split() == ["True", "False", "False", "True", "True"], r.stdout + r.stderr


def test_every_source_and_header_is_in_the_build_and_its_cache_key() -> None:
    """A file left out of SOURCES is not compiled; one left out of HEADERS does not move the cache directory,
    so an edit to it would load the old build's library."""
    assert {p.name for p in build.CSRC.glob("*.cpp")} == {s.name for s in build.SOURCES}
    assert {p.name for p in build.CSRC.glob("*.h")} == {h.name for h in build.HEADERS}
