"""Which kernel builds this machine runs, read from /proc/cpuinfo and the OS, never from the kernels themselves.

The bitwise tests run every build against the scalar one. If they took the list from the kernels' own detection
(OPS.q8_isa()), a detection that wrongly said "scalar" would make every one of them pass without running a vector
instruction. So they take it from here, and tests/test_kernel_library.py fails when the kernels run fewer builds
than this says the CPU has. The numbering is the kernels' (csrc/isa.h): 0 scalar, 1 avx2, 2 avx512, 3 amx.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

NAMES = ("scalar", "avx2", "avx512", "amx")
_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 0x1023, 18


@cache
def cpu_flags() -> frozenset[str]:
    """The first processor's flags line of /proc/cpuinfo."""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@cache
def amx_granted() -> bool:
    """Whether Linux grants this process the AMX tile state (asked here, by syscall, not through the kernels)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def _cap() -> int:
    """STEADYSERVE_ISA, where a run sets it on purpose to check a narrower build."""
    value = os.environ.get("STEADYSERVE_ISA", "")
    return NAMES.index(value) if value in NAMES else 3


def float_best() -> int:
    """The float32 family's widest build the CPU has (no AMX build), capped by STEADYSERVE_ISA."""
    f = cpu_flags()
    avx2 = {"avx", "avx2", "fma", "f16c"} <= f
    have = 2 if avx2 and {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= f else 1 if avx2 else 0
    return min(have, _cap())


def attention_q8_build(float_build: int) -> int:
    """The attention build a q8_0 cache runs where the float32 family runs `float_build`: the same, but its AVX-512
    build needs AVX512_VNNI (the integer scores), so AVX2 on an AVX-512 CPU without it."""
    return 1 if float_build == 2 and "avx512_vnni" not in cpu_flags() else float_build


def int8_best() -> int:
    """The int8 family's widest build the CPU has, capped by STEADYSERVE_ISA."""
    f = cpu_flags()
    avx2 = {"avx", "avx2", "fma", "f16c"} <= f
    if avx2 and {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= f:
        have = 3 if {"amx_tile", "amx_int8"} <= f and _cap() >= 3 and amx_granted() else 2
    else:
        have = 1 if avx2 else 0
    return min(have, _cap())


FLOAT_BUILDS = list(range(float_best() + 1))
INT8_BUILDS = list(range(int8_best() + 1))
