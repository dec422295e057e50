"""The numerics path: which ISA-dependent code computes a process's bits, and its id in the fingerprint.

PyTorch's vectorized CPU kernels and MKL's GEMMs both pick code by CPU, and the code they pick
changes the bits (an Intel Xeon gave four different log-softmax hashes for one prompt under the
four combinations of ATEN_CPU_CAPABILITY=avx2 and MKL_CBWR=AVX2,STRICT). So the fingerprint names
the path, and there are two:

* host (the default): PyTorch's fastest kernels for this CPU and MKL in strict reproducibility
  mode on the branch it picks for this CPU (MKL_CBWR=AUTO,STRICT). Bits repeat on the same kind of
  machine; the id hashes every fact that picks a kernel (CPU vendor and ISA flags, PyTorch's
  dispatch, MKL's mode, library versions), so two machine kinds get two ids.
* portable (`--numerics portable`): PyTorch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2) and MKL's
  COMPATIBLE branch in strict mode (MKL_CBWR=COMPATIBLE,STRICT). COMPATIBLE is the branch MKL
  runs the same way on Intel and AMD; its AVX2 and AVX-512 branches are not honoured on AMD
  (measured on an AMD EPYC: MKL_CBWR=AVX2,STRICT, AVX512,STRICT and AUTO,STRICT gave the same bits,
  COMPATIBLE others). The native attention kernel reduces in the same order at every vector width.
  Any x86-64 host with AVX2 then computes the same bits, so the id names no host fact.

Both ids include NUMERICS_VERSION, bumped whenever steadyserve's own arithmetic changes, and the
PyTorch and MKL versions. MKL and PyTorch read their settings once, before the first GEMM: a
process gets its path from the environment it starts with (`apply_env`, from steadyserve's
`__init__`), and `steadyserve serve --numerics portable` re-executes itself with it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from .config import ConfigError

# 1: fma attention kernel nat1, MKL strict mode; 2: LM head computed in 2048-column GEMMs.
NUMERICS_VERSION = 2
MODES = ("host", "portable")
ENV = "STEADYSERVE_NUMERICS"  # host | portable: the path this process starts with
PORTABLE_ENV = {"MKL_CBWR": "COMPATIBLE,STRICT", "ATEN_CPU_CAPABILITY": "avx2"}
HOST_ENV = {"MKL_CBWR": "AUTO,STRICT"}  # defaults only: an operator's own setting wins (and is named)


class NumericsError(ConfigError):
    """The process cannot run the numerics path it was asked for."""


def apply_env() -> None:
    """Set the libraries' dispatch variables for the path in $STEADYSERVE_NUMERICS (before torch loads)."""
    wanted = PORTABLE_ENV if os.environ.get(ENV) == "portable" else HOST_ENV
    for key, value in wanted.items():
        os.environ.setdefault(key, value)


def env_for(mode: str) -> dict[str, str]:
    """The environment a fresh process needs to run `mode`."""
    env = dict(os.environ)
    env[ENV] = mode
    for key, value in PORTABLE_ENV.items():
        if mode == "portable":
            env[key] = value
        elif env.get(key) == value:  # a host process started from a portable one drops the pins
            del env[key]
    return env


def started_as(mode: str) -> bool:
    """Whether this process started with the environment `mode` needs."""
    return (os.environ.get(ENV) == "portable") == (mode == "portable")


@dataclass(frozen=True)
class Numerics:
    mode: str  # host | portable
    numerics_id: str  # "p" or "h" and 6 hex digits of the facts' hash: the fingerprint's numerics part
    facts: dict[str, str]  # what the id hashes, for `steadyserve info` and the model-info endpoints

    def describe(self) -> str:
        return f"{self.mode} ({self.numerics_id}): " + ", ".join(f"{k}={v}" for k, v in self.facts.items())


def started_mode() -> str:
    """The path this process's environment set up at start."""
    return "portable" if os.environ.get(ENV) == "portable" else "host"


def describe(mode: str, isa: str, cpu_model: str, cpu_flags: tuple[str, ...], torch_version: str, mkl_version: str,
             mkl_cbwr: str, mkl_enable_instructions: str) -> Numerics:
    """The id of `mode` given the process's dispatch facts (no checks: see `resolve`)."""
    facts = {"version": str(NUMERICS_VERSION), "torch": torch_version, "mkl": mkl_version or "none"}
    if mode == "portable":
        facts["path"] = "torch-avx2+mkl-compatible-strict"
    else:
        facts.update({"torch_isa": isa, "cpu": _vendor(cpu_model), "cpu_flags": " ".join(cpu_flags),
                      "mkl_cbwr": mkl_cbwr or "unset"})
        if mkl_enable_instructions:
            facts["mkl_enable_instructions"] = mkl_enable_instructions
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:6]
    return Numerics(mode, ("p" if mode == "portable" else "h") + digest, facts)


def resolve(mode: str) -> Numerics:
    """This process's numerics path, checked against `mode`. Raises NumericsError when it cannot be `mode`."""
    from .platform_info import platform_info

    if mode not in MODES:
        raise NumericsError(f"--numerics must be one of {', '.join(MODES)}, not {mode!r}")
    p = platform_info()
    if mode != started_mode():
        raise NumericsError(f"this process started with {started_mode()} numerics and cannot switch to {mode}: "
                            f"start it with {ENV}={mode} (the steadyserve command does so itself)")
    if mode == "portable":
        if p.mkl_cbwr != PORTABLE_ENV["MKL_CBWR"]:
            raise NumericsError(f"portable numerics need MKL_CBWR={PORTABLE_ENV['MKL_CBWR']} from process start, "
                                f"found {p.mkl_cbwr or 'unset'}")
        if p.isa != "AVX2":
            raise NumericsError(f"portable numerics need PyTorch's AVX2 kernels; this process dispatches to {p.isa} "
                                f"(the CPU lacks AVX2, or ATEN_CPU_CAPABILITY was set otherwise at start)")
    return p.numerics


def _vendor(cpu_model: str) -> str:
    """MKL's AUTO branch depends on the vendor, not only on the ISA flags."""
    m = cpu_model.lower()
    return "intel" if "intel" in m else "amd" if "amd" in m else "other"
