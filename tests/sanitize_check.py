"""`make sanitize` runs this file first: the kernels it tests really run under AddressSanitizer and UBSan.

Not a test_*.py file, so the suite never collects it; the target names it. It trusts nothing build.py says
about itself: it reads the process's own memory map for the sanitizers' runtimes, the ELF of the library the
process actually loaded for the instrumented code's calls into them, and makes the runtimes report a fault.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import torch

from steadyserve.kernels import load

LIBRARY = "steadyserve_kernels.so"
# UBSan handlers that never return, so have no separate _abort form: reaching __builtin_unreachable, falling off
# the end of a function that returns a value.
ALWAYS_FATAL = {"__ubsan_handle_builtin_unreachable", "__ubsan_handle_missing_return"}


def _mapped() -> list[str]:
    return [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if len(line.split()) >= 6]


def _loaded_kernels() -> Path:
    st = load()
    assert st.available, st.detail
    torch.ops.steadyserve.paged_attention  # noqa: B018 - registered
    paths = {p for p in _mapped() if Path(p).name == LIBRARY}
    assert len(paths) == 1, f"expected one {LIBRARY} mapped into this process, found {sorted(paths)}"
    return Path(paths.pop())


def test_the_sanitizer_runtimes_are_mapped_into_this_process() -> None:
    names = {Path(p).name for p in _mapped()}
    assert any(n.startswith("libasan.so") for n in names), "libasan is not loaded: run through `make sanitize`"
    assert any(n.startswith("libubsan.so") for n in names), "libubsan is not loaded: run through `make sanitize`"
    libc = ctypes.CDLL(None)
    assert hasattr(libc, "__asan_init") and hasattr(libc, "__ubsan_handle_add_overflow_abort"), \
        "the sanitizers' entry points do not resolve in this process"


def test_the_loaded_kernel_library_is_instrumented() -> None:
    """The .so this process mapped (not the one build.py names) needs libasan and libubsan and calls into them:
    ASan's checks on loads and stores, UBSan's aborting handlers (-fno-sanitize-recover)."""
    so = _loaded_kernels()
    needed = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    assert "libasan.so" in needed and "libubsan.so" in needed, needed
    syms = subprocess.run(["readelf", "-W", "--dyn-syms", str(so)], capture_output=True, text=True, check=True).stdout
    undefined = {line.split()[7].split("@")[0] for line in syms.splitlines()
                 if len(line.split()) >= 8 and line.split()[6] == "UND"}
    asan = {s for s in undefined if s.startswith("__asan_report_")}
    ubsan = {s for s in undefined if s.startswith("__ubsan_handle_") and s.endswith("_abort")}
    assert len(asan) >= 4, f"no ASan load/store checks in {so}: {sorted(asan)}"
    assert ubsan, f"no aborting UBSan handlers in {so}"
    recoverable = {s for s in undefined if s.startswith("__ubsan_handle_") and not s.endswith("_abort")}
    assert not recoverable - ALWAYS_FATAL, f"recoverable UBSan handlers (no -fno-sanitize-recover): {recoverable}"
    # And it is not the everyday build: that one lives in another cache directory.
    env = {k: v for k, v in os.environ.items() if k not in ("STEADYSERVE_SANITIZE", "LD_PRELOAD")}
    plain = subprocess.run([sys.executable, "-c", "from steadyserve.kernels.build import _cache_dir; "
                            "print(_cache_dir())"], capture_output=True, text=True, check=True, env=env).stdout.strip()
    assert Path(plain) != so.parent, f"the sanitized build shares the everyday build's cache directory {plain}"


def test_the_runtime_reports_a_heap_overflow() -> None:
    """A child process reads one byte past a heap buffer through ASan's own check: the runtime is live (not just
    mapped), reports it, and ends the process with a failure."""
    code = ("import ctypes; libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; "
            "p = libc.malloc(16); libc.__asan_report_load1(ctypes.c_void_p(p + 16))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0, res.stderr[-2000:]
    assert "AddressSanitizer: heap-buffer-overflow" in res.stderr, res.stderr[-2000:]
