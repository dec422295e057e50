"""Build and load the native kernels, once per source version, into a cache.

    python -m steadyserve.kernels     # what `make install` and the Dockerfile run

Flags are part of the numerics: -O3 without -ffast-math and with
-ffp-contract=off (no fused multiply-add the source does not write), and no
-march: the kernels pick their vector width at run time (isa.h, one build per instruction set) with
the same bits on each. -O3 over -O2 only changes speed (it halved prefill
attention time: more of the loops vectorized), never an IEEE operation.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernel_versions import KERNELS

log = logging.getLogger("steadyserve.kernels")

CSRC = Path(__file__).parent / "csrc"
# Every source and header in the folder: a file added there is built and keys the cache with no list to update.
# paged_attention.cpp stays first: tests/test_attention_kernel.py builds it alone at each vector width.
SOURCES = sorted(CSRC.glob("*.cpp"), key=lambda p: (p.name != "paged_attention.cpp", p.name))
HEADERS = sorted(CSRC.glob("*.h"))
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-fno-unsafe-math-optimizations"]
LDFLAGS = ["-fopenmp"]
# STEADYSERVE_SANITIZE=1 (`make sanitize`; read here only): the same flags plus AddressSanitizer and
# UndefinedBehaviorSanitizer, so another cache key and directory. float-cast-overflow (a float converted to an
# integer type that cannot hold it) is not part of GCC's "undefined"; -g1 (line tables, no change to the code
# GCC generates) puts file:line in ASan's reports. For tests only: the process must load the sanitizers'
# runtimes before anything else (the Makefile's LD_PRELOAD), or ASan aborts it at load.
SANITIZE = os.environ.get("STEADYSERVE_SANITIZE", "").strip() == "1"
if SANITIZE:
    CFLAGS = CFLAGS + ["-fsanitize=address,undefined,float-cast-overflow", "-fno-omit-frame-pointer",
                       "-fno-sanitize-recover=undefined,float-cast-overflow", "-g1"]
    LDFLAGS = LDFLAGS + ["-fsanitize=address,undefined"]
# The kernels' versions have one owner, kernel_versions.KERNELS, from which the numerics ids derive.
NATIVE_KERNEL_ID = KERNELS["attention"]  # the attention kernel's id in the fingerprint
PYTHON_KERNEL_ID = "py"


@dataclass(frozen=True)
class KernelStatus:
    """Which attention kernel a process can use, and why."""

    available: bool  # the native extension is built and registered
    kernel_id: str  # "nat1" when available; the fingerprint names it
    detail: str  # one line: where it was built from, or why it could not be


_status: KernelStatus | None = None


def _compiler_identity() -> str:
    """The compiler torch's cpp_extension will call ($CXX, else c++) and its version line: another compiler (or
    version) may schedule or vectorize differently, so its objects are a different build, not this one reused."""
    cxx = os.environ.get("CXX", "c++")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cxx}: {type(e).__name__}"
    return f"{cxx}: {out.splitlines()[0] if out else ''}"


def _cache_dir() -> Path:
    root = os.environ.get("STEADYSERVE_CACHE") or os.path.join(Path.home(), ".cache", "steadyserve")
    h = hashlib.sha256()
    for src in SOURCES + HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(_compiler_identity().encode())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    # ninja's build file names the sources' and torch's absolute paths: two checkouts or venvs sharing one
    # directory would rebuild over each other's objects, so each gets its own.
    h.update(str(CSRC.resolve()).encode())
    h.update(sys.prefix.encode())
    return Path(root) / "kernels" / h.hexdigest()[:16]


BUILT_MARK = "built.ok"  # written after a build and registration succeeded; the .so beside it is complete
LIBRARY = "steadyserve_kernels.so"
TORCH_BATON = "lock"  # torch.utils.cpp_extension's lock file: left behind by a killed build, it blocks forever


@dataclass(frozen=True)
class _Library:
    """One shared library of ops: the production kernels, or the test-only ops beside them."""

    name: str  # the .so's name without the suffix
    sources: tuple[Path, ...]
    ldflags: tuple[str, ...]
    probe: str  # an op it registers: present once registration worked


def _production() -> _Library:
    return _Library(LIBRARY.removesuffix(".so"), tuple(SOURCES), tuple(LDFLAGS), "paged_attention")


def _load_built(build_dir: Path, lib: _Library | None = None) -> bool:
    """Register a library a finished build left in `build_dir`; no ninja, no lock, read-only is fine."""
    lib = lib or _production()
    if not (build_dir / BUILT_MARK).exists():
        return False
    try:
        torch.ops.load_library(str(build_dir / f"{lib.name}.so"))
        getattr(torch.ops.steadyserve, lib.probe)  # raises if registration failed
    except (OSError, RuntimeError, AttributeError):
        return False
    return True


def _build(build_dir: Path, lib: _Library | None = None) -> None:
    """Compile with torch's cpp_extension under an flock, which the kernel drops when its holder dies.

    torch's own lock is a file that marks a build in progress: a build that is killed (a CI timeout, a
    SIGKILL during `make install`) leaves it, and every later build of the same sources waits on it forever.
    Under our flock no other build of this directory runs, so such a file is stale and is removed."""
    from torch.utils.cpp_extension import load as cpp_load

    lib = lib or _production()
    try:  # the ninja wheel's binary, when the venv's bin is not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.flock", "a") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)  # waits for a live build of the same sources, never for a dead one
        try:
            if _load_built(build_dir, lib):  # built by the process we waited for
                return
            (build_dir / TORCH_BATON).unlink(missing_ok=True)
            (build_dir / BUILT_MARK).unlink(missing_ok=True)
            cpp_load(name=lib.name, sources=[str(s) for s in lib.sources], extra_cflags=CFLAGS,
                     extra_ldflags=list(lib.ldflags), build_directory=str(build_dir), is_python_module=False,
                     verbose=False)
            getattr(torch.ops.steadyserve, lib.probe)  # raises if registration failed
            (build_dir / BUILT_MARK).touch()
        finally:
            fcntl.flock(flock, fcntl.LOCK_UN)


def load() -> KernelStatus:
    """Register the native kernels, building them first (~40 s) if this version was never built; never raises."""
    global _status
    if _status is not None:
        return _status
    t0 = time.perf_counter()
    try:
        build_dir = _cache_dir()
        if not _load_built(build_dir):
            _build(build_dir)
        took = time.perf_counter() - t0
        _status = KernelStatus(True, NATIVE_KERNEL_ID,
                               f"native kernels {'+'.join(KERNELS.values())} from {build_dir} ({took:.1f} s)")
    except Exception as e:  # no compiler, no ninja, a read-only cache...
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        _status = KernelStatus(False, PYTHON_KERNEL_ID, f"native kernels unavailable, using Python attention: {reason}")
        log.warning(_status.detail)
    return _status


# The test-only ops (csrc/testing): each runs one kernel alone against a reference. Not in the production library.
TEST_SOURCES = (CSRC / "testing" / "test_ops.cpp",)


def load_test_ops() -> None:
    """Register the test-only ops (for tests): a library of their own that links the production one, built once per
    source version beside it. Raises where the production kernels are unavailable or the build fails."""
    status = load()
    if not status.available:
        raise RuntimeError(status.detail)
    if hasattr(torch.ops.steadyserve, "q8quantize"):
        return
    prod = _cache_dir()
    h = hashlib.sha256(b"".join(p.read_bytes() for p in TEST_SOURCES)).hexdigest()[:12]
    lib = _Library("steadyserve_test_ops", TEST_SOURCES,
                   (*LDFLAGS, f"-L{prod}", f"-l:{LIBRARY}", f"-Wl,-rpath,{prod}"), "q8quantize")
    build_dir = prod / f"test_ops-{h}"
    if not _load_built(build_dir, lib):
        _build(build_dir, lib)


def kernel_status() -> KernelStatus | None:
    """The result of `load()` if it ran in this process, else None."""
    return _status



# The vector builds by the index the extension reports (qmm_isa, q8_isa): names for the fingerprint's neighbours
# (self-test line, golden files, conformance records). Every build of a family computes the same bits.
FLOAT_BUILDS = ("scalar", "avx2", "avx512")
INT8_BUILDS = ("scalar", "avx2", "avx512 vnni", "amx + avx512 vnni")


def float_build() -> str:
    """The float32 matmul family's build this process runs (the extension must be loaded)."""
    return FLOAT_BUILDS[torch.ops.steadyserve.qmm_isa()]


def int8_build() -> str:
    """The int8 family's build this process runs: AMX tiles where CPUID reports them and the OS grants the tile
    state (for 16 rows or more; fewer rows run AVX-512 VNNI), else the widest vector build."""
    return INT8_BUILDS[torch.ops.steadyserve.q8_isa()]


def register_rows() -> int:
    """Rows up to which the float32 family's matmul dequantizes each weight once in registers for all of them (1, 4
    or 8 by build): a step of that many rows costs little more than one, so speculation sizes its drafts by it."""
    return int(torch.ops.steadyserve.qmm_register_rows())
