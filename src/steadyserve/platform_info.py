"""What this machine computes with: the facts that decide which kernels run, and so which bits come out.

Batch invariance is verified per machine (the row-tile ladder is calibrated at start-up), and the CPUs
this project meets differ: AMD EPYC with AVX2, Intel Xeon with AVX-512 and AMX. `steadyserve info`,
`GET /v1/models` and gRPC `GetModelInfo` all report the same `PlatformInfo`, collected here, so a result can
be tied to the hardware and library build that produced it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from .cpu_budget import CpuBudget, cpus
from .memory import MemoryLimit, human
from .numerics import NATIVE_PATHS, Numerics, active, describe

# CPU feature flags that change which kernels PyTorch, oneDNN and MKL pick (from /proc/cpuinfo).
_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class PlatformInfo:
    cpu_model: str  # e.g. "AMD EPYC 9R14" or "Intel(R) Xeon(R) Platinum 8488C"; "unknown" if not found
    cpu_flags: tuple[str, ...]  # the subset of _FLAGS this CPU has
    num_cpus: int  # logical CPUs the OS reports
    isa: str  # the ISA PyTorch's CPU kernels dispatch to: torch.backends.cpu.get_cpu_capability()
    torch_version: str
    mkl_version: str  # the MKL PyTorch is linked with; "" when it has none
    mkl_cbwr: str  # the MKL_CBWR environment value (conditional numerical reproducibility); "" when unset
    mkl_enable_instructions: str  # MKL_ENABLE_INSTRUCTIONS (caps MKL's dispatch); "" when unset
    numerics: Numerics | None = None  # the numerics path this process runs (numerics.py) and its id
    row_tiles: tuple[int, ...] = field(default=())  # the verified row-tile ladder; () when not calibrated/off
    memory_limit_bytes: int = 0  # the effective memory limit read at start-up (memory.py); 0 = unknown / not read
    memory_limit_source: str = ""  # which term set it: cgroup v2 memory.max, cgroup v1 ..., MemAvailable + RSS, --memory-limit
    threads: int = 0  # torch intra-op threads, from the CPU budget read at start-up (cpu_budget.py); 0 = not read
    threads_source: str = ""  # what decided them: a cgroup quota's file and values, the affinity mask or --threads N
    cpu_quota: float = 0.0  # CPUs the cgroup CPU quota allows (quota / period, smallest up the tree); 0 = no quota
    cpu_affinity: int = 0  # CPUs in this process's affinity mask (sched_getaffinity); 0 = unknown

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_flags"] = list(self.cpu_flags)
        d["row_tiles"] = list(self.row_tiles)
        d["numerics"] = self.numerics.mode if self.numerics else ""
        d["numerics_id"] = self.numerics.numerics_id if self.numerics else ""
        return d

    def lines(self) -> list[tuple[str, str]]:
        """(label, value) pairs for a human-readable report."""
        portable = self.numerics is not None and self.numerics.mode in NATIVE_PATHS
        quota = cpus(self.cpu_quota) if self.cpu_quota else "none"
        tiles = (", ".join(map(str, self.row_tiles)) if self.row_tiles
                 else "none (portable numerics: every row independent by construction)" if portable
                 else "none (batch invariance off)")
        return [
            ("cpu", f"{self.cpu_model} ({self.num_cpus} CPUs; {' '.join(self.cpu_flags) or 'no AVX2'})"),
            ("isa", f"{self.isa} (torch.backends.cpu.get_cpu_capability())"),
            ("torch", self.torch_version),
            ("mkl", f"{self.mkl_version or 'none'}; MKL_CBWR={self.mkl_cbwr or '(unset)'}"
                    + (f"; MKL_ENABLE_INSTRUCTIONS={self.mkl_enable_instructions}"
                       if self.mkl_enable_instructions else "")),
            ("row tiles", f"[{tiles}]" if self.row_tiles else tiles),
            ("numerics", self.numerics.describe() if self.numerics else "unknown"),
            ("memory limit", f"{human(self.memory_limit_bytes)} ({self.memory_limit_source})"
                             if self.memory_limit_bytes else "unknown"),
            ("threads", f"{self.threads} ({self.threads_source}; cgroup CPU quota {quota}, affinity "
                        f"{self.cpu_affinity or 'unknown'} of {self.num_cpus} CPUs)" if self.threads else "unknown"),
        ]


def _cpuinfo() -> tuple[str, tuple[str, ...]]:
    model, flags = "", set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    model = model or platform.processor() or platform.machine() or "unknown"
    return model, tuple(f for f in _FLAGS if f in flags)


def _mkl_version(torch: Any) -> str:
    if not torch.backends.mkl.is_available():
        return ""
    try:  # MKL is linked into libtorch_cpu; its version function is exported
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, len(buf))
        text = buf.value.decode(errors="replace")
    except (OSError, AttributeError):
        text = torch.__config__.show()
    m = re.search(r"Math Kernel Library Version ([\w.\-]+(?: Build \d+)?)", text)
    return m.group(1).replace("-Product", "") if m else "present (version unknown)"


@lru_cache(maxsize=1)
def _static() -> PlatformInfo:
    import torch

    model, flags = _cpuinfo()
    facts = dict(isa=str(torch.backends.cpu.get_cpu_capability()), cpu_model=model, cpu_flags=flags,
                 torch_version=torch.__version__, mkl_version=_mkl_version(torch),
                 mkl_cbwr=os.environ.get("MKL_CBWR", ""),
                 mkl_enable_instructions=os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""))
    return PlatformInfo(num_cpus=os.cpu_count() or 1, **facts)


def numerics_for(mode: str) -> Numerics:
    """The id of path `mode` (portable | host) on this process's platform."""
    p = _static()
    return describe(mode, isa=p.isa, cpu_model=p.cpu_model, cpu_flags=p.cpu_flags, torch_version=p.torch_version,
                    mkl_version=p.mkl_version, mkl_cbwr=p.mkl_cbwr, mkl_enable_instructions=p.mkl_enable_instructions)


def platform_info(row_tiles: list[int] | tuple[int, ...] | None = None,
                  memory: MemoryLimit | None = None, cpu: CpuBudget | None = None) -> PlatformInfo:
    """This process's platform facts; `row_tiles` is the verified ladder (`loaded.model.tiler.tiles` when the
    tiler is enabled), `memory` the limit and `cpu` the CPU budget read at start-up, all reported as given. The
    environment is read once per process, as MKL reads it."""
    base = _static()
    return dataclasses.replace(base, row_tiles=tuple(row_tiles or ()), numerics=active(),
                               memory_limit_bytes=memory.limit if memory else 0,
                               memory_limit_source=memory.source if memory else "",
                               **(cpu.as_dict() if cpu else {}))


def row_tiles_of(loaded: Any) -> tuple[int, ...]:
    """The verified tile ladder of a loaded model; () when batch invariance is off."""
    tiler = loaded.model.tiler
    return tuple(tiler.tiles) if tiler.enabled else ()
