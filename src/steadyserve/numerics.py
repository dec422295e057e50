"""The numerics path: which code computes a process's bits, and its id in the fingerprint.

There are three paths:

* portable (`--numerics portable`: float32 activations, for exact-parity scoring): every operation
  that can round differently on another machine runs in steadyserve's own native kernels
  (kernels/csrc): the matmul family over the weights as the GGUF stores them (qmm.h: 16 fma
  lanes over K, one fixed lane tree), RMSNorm, SiLU·mul and
  log-softmax with the same 16-lane sums and an exp/log made of IEEE mul/add only, RoPE, and
  the paged attention kernel. What is left to PyTorch is exact on any CPU (additions of two
  tensors, copies, gathers). The reduction order depends on nothing about the host: not the
  vendor, not AVX2 versus AVX-512 (both builds hold the same 16 lanes), not the thread count
  (threads split outputs, never a sum), not PyTorch's or MKL's dispatch, which it does not
  use. So the id names no host fact, and every x86-64 machine computes the same bits.
  Batch invariance holds by construction: no kernel looks at how many rows it was given.
* int8 (the default): the portable path with int8 activations in the matmuls. Each activation
  row is quantized per block of 32 to int8 from that block alone, the weights are repacked once at
  load into 16-row panels, and every block's dot product is an exact integer sum (VNNI, AVX2's
  maddubs or plain loops: any order gives the same integer); only the per-block scales are float,
  applied in one chain per output (kernels/csrc/q8.h). Everything else is the portable path's. It is
  as portable and as batch-invariant as that path, by the same construction, and 2-9x faster per
  matmul; its logprobs differ from float32 activations' by the quantization (measured in
  benchmarks/int8_accuracy.py), so exact-parity scoring keeps `--numerics portable`.
* host (`--numerics host`): the weights dequantized to float32, MKL's GEMMs in strict
  reproducibility mode on the branch MKL picks for this CPU (MKL_CBWR=AUTO,STRICT) and
  PyTorch's kernels for this CPU, with the row counts verified at start-up (models/layers.py,
  RowTiler). Bits repeat on the same kind of machine only, so the id hashes every fact that
  picks a kernel (CPU vendor and flags, PyTorch's dispatch, MKL's mode, library versions).
  CUDA always runs this path, under its own device in the fingerprint.

`auto` (the default setting) is DEFAULT_NATIVE_PATH where the native kernels are built and the
model can run on them (CPU, float32 activations), else host, with a warning; the fingerprint says
which. The native paths' ids hash the kernel versions they stand for (kernel_versions.py), and every
id includes NUMERICS_VERSION, bumped whenever steadyserve's own arithmetic outside the kernels changes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from .config import NUMERICS_MODES, ConfigError, choice_error
from .kernel_versions import PATH_KERNELS, kernels_of

# 1: fma attention kernel nat1, MKL strict mode; 2: LM head computed in 2048-column GEMMs;
# 3: the native matmul family (qmm1) and native row-wise ops for the portable path;
# 4: RoPE tables' cos and sin by models/rope_trig.py's fixed float64 method, not PyTorch's math library.
NUMERICS_VERSION = 4
MODES = NUMERICS_MODES  # the settings of --numerics (config.py owns the list)
NATIVE_PATHS = tuple(PATH_KERNELS)  # the concrete paths that run steadyserve's own kernels: portable, int8
_PREFIX = {"portable": "p", "int8": "i", "host": "h"}
HOST_ENV = {"MKL_CBWR": "AUTO,STRICT"}  # defaults only: an operator's own setting wins (and is named)


class NumericsError(ConfigError):
    """The process cannot run the numerics path it was asked for."""


def apply_env() -> None:
    """MKL's strict mode for the host path, before torch loads (MKL reads it once)."""
    for key, value in HOST_ENV.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class Numerics:
    mode: str  # portable | int8 | host
    numerics_id: str  # "p", "i" or "h" and 6 hex digits of the facts' hash: the fingerprint's numerics part
    facts: dict[str, str]  # what the id hashes, for `steadyserve info` and the model-info endpoints

    def describe(self) -> str:
        return f"{self.mode} ({self.numerics_id}): " + ", ".join(f"{k}={v}" for k, v in self.facts.items())


def describe(mode: str, isa: str, cpu_model: str, cpu_flags: tuple[str, ...], torch_version: str, mkl_version: str,
             mkl_cbwr: str, mkl_enable_instructions: str) -> Numerics:
    """The id of `mode` (portable | host) given the process's dispatch facts."""
    facts = {"version": str(NUMERICS_VERSION)}
    if mode in NATIVE_PATHS:
        facts["kernels"] = kernels_of(mode)
    else:
        facts.update({"torch": torch_version, "mkl": mkl_version or "none", "torch_isa": isa,
                      "cpu": _vendor(cpu_model), "cpu_flags": " ".join(cpu_flags), "mkl_cbwr": mkl_cbwr or "unset"})
        if mkl_enable_instructions:
            facts["mkl_enable_instructions"] = mkl_enable_instructions
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:6]
    return Numerics(mode, _PREFIX[mode] + digest, facts)


def choose(mode: str, *, native_available: bool, native_detail: str, device_type: str, dtype: str,
           batch_invariant: bool = True) -> str:
    """The concrete path (portable | int8 | host) for the setting `mode`. Raises NumericsError when `mode`
    is portable or int8 and the model cannot run on it; `auto` falls back to host instead (the caller warns)."""
    if mode not in MODES:
        raise NumericsError(choice_error("--numerics", mode, MODES))
    if mode == "host":
        return "host"
    why = ""
    if not batch_invariant:
        why = "portable numerics are batch-invariant by construction; --no-batch-invariant runs the host path"
    elif device_type != "cpu":
        why = f"portable numerics run on the CPU; {device_type} runs the host path"
    elif dtype not in ("float32", "auto"):
        why = f"portable numerics compute in float32; --dtype {dtype} runs the host path"
    elif not native_available:
        why = f"portable numerics need the native kernels: {native_detail}"
    if not why:
        return DEFAULT_NATIVE_PATH if mode == "auto" else mode
    if mode in NATIVE_PATHS:
        raise NumericsError(f"--numerics {mode}: {why.replace('portable numerics', f'{mode} numerics')}")
    return "host"


# What `auto` runs where the native kernels can: decided here, once, for every host (fleet bits depend on it).
# int8 since NUMERICS_VERSION 4: it keeps every promise of portable (the same bits on every x86-64 host, batch
# invariance), runs 2-3x faster at 135M-1.7B sizes on the machines measured, and its logprob error against float32
# is at most llama.cpp's on the same GGUF (benchmarks/RESULTS.md); portable stays, named, for exact parity.
DEFAULT_NATIVE_PATH = "int8"

_active: Numerics | None = None


def activate(numerics: Numerics) -> None:
    """Record the path this process's model computes with (platform reports read it)."""
    global _active
    _active = numerics


def active() -> Numerics | None:
    """The path of the loaded model, or None before one is loaded."""
    return _active


def _vendor(cpu_model: str) -> str:
    """MKL's AUTO branch depends on the vendor, not only on the ISA flags."""
    m = cpu_model.lower()
    return "intel" if "intel" in m else "amd" if "amd" in m else "other"
